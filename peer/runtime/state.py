"""A peer's persistent state: the one checkpoint schema (save / restore / roll back), and the fleet-level views of
many peers' models (average model, consensus distance) with one definition each.

Checkpoint (``checkpoint.pt``, written by the daemon, ``train`` and read by ``fleet`` and the tests)::

    schema       SCHEMA (int); another value is refused
    fingerprint  model architecture + config; another model's checkpoint is refused
    peer_id, round, steps
    engine       GossipEngine.state_dict(): x, w, layout, codec, ledgers with in-flight records (named fields), the
                 algorithm's own state; :func:`engine_of` rebuilds the engine from it alone
    optimizer    PushSumSGD.state_dict()
    buffers      the model's buffers (activation-quantizer ranges), restored with the model
    spec         the RunSpec as plain data
    recovery     divergence recoveries and gamma halvings so far (optional: older files have none)
    info         the model's source, classes, input shape and normalisation (optional; runtime.build.BuiltModel.info),
                 plus the peer's last test accuracy where it has one: what an exported model's card says

Writes are atomic (temporary file, fsync, rename, directory fsync): a crash or power cut leaves the old or the new
checkpoint, never a torn one; a temporary file a crash left behind is removed by :func:`remove_stale_temps` at the
next start. The daemon keeps the previous checkpoint beside the newest (``previous``) and falls back to it when the
newest is unreadable (:func:`load_newest`). Loads use torch's weights-only unpickler, so a planted file cannot run
code. A checkpoint is checked on save and on load (:func:`check_sane`: x, the model's buffers and z = x / w finite,
0 < w <= the fleet's bound): a poisoned model is never written (the previous file stays), and a poisoned file is
refused like a torn one, so the daemon falls back to the previous checkpoint instead of crash-looping on it.
"""

from __future__ import annotations

import errno
import math
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from peer.errors import PeerError
from peer.finite import all_finite, max_abs
from peer.gossip.engine import GossipEngine
from peer.gossip.ledger import DEFAULT_MAX_PEERS
from peer.runtime.peer import Peer

#: Version of the checkpoint layout above. 3: in-flight records with named fields, the engine's layout and codec
#: (2 kept positional tuples; its files are refused by :func:`load`, naming both numbers).
SCHEMA = 3


class CheckpointError(PeerError, RuntimeError):
    """A checkpoint is missing, unreadable, of another schema or for another model; the message names the file."""

    default_reason = "checkpoint"


def save_atomic(obj: Any, path: str | Path, previous: str | Path | None = None) -> Path:
    """torch.save ``obj`` to ``path`` atomically; returns the path. With ``previous``, the file ``path`` held is
    kept there (renamed, so at every instant one of the two is a whole checkpoint)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            try:
                torch.save(obj, fh)
            except RuntimeError as exc:  # torch's writer reports a failed write (ENOSPC, EIO) as a RuntimeError
                code = _write_errno(target.parent)
                raise OSError(code, f"{os.strerror(code)}: checkpoint write to {target} failed ({exc})") from exc
            fh.flush()
            os.fsync(fh.fileno())
        if previous is not None and target.exists():
            os.replace(target, previous)
        os.replace(tmp, target)
        dir_fd = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


#: Free bytes (for an unprivileged writer) under which a failed checkpoint write is reported as a full disk: torch's
#: writer fails on a short write ("unexpected pos") while a few blocks may still be free.
FULL_BELOW_BYTES = 1 << 20


def _write_errno(directory: Path) -> int:
    """ENOSPC when ``directory``'s file system has less than :data:`FULL_BELOW_BYTES` left for an unprivileged
    writer, else EIO."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return errno.EIO
    return errno.ENOSPC if st.f_bavail * st.f_frsize < FULL_BELOW_BYTES else errno.EIO


def check_sane(state: dict[str, Any], source: str | Path, max_weight: float = DEFAULT_MAX_PEERS) -> None:
    """Refuse a checkpoint no healthy peer could hold: non-finite x or buffers, a push-sum weight w outside
    (0, ``max_weight``] (a fleet's weights sum to its number of peers, at most ``net.max_peers``), or a de-biased
    model z = x / w that overflows.

    Raises:
        CheckpointError: naming ``source`` and the field.
    """
    engine = state["engine"]
    x, w = engine["x"], engine["w"]
    if not isinstance(w, (int, float)) or not math.isfinite(w) or not 0.0 < w <= max_weight:
        raise CheckpointError(f"checkpoint {source}: push-sum weight w = {w!r} outside (0, {max_weight:g}]")
    if not all_finite(x):
        raise CheckpointError(f"checkpoint {source}: x holds {int((~torch.isfinite(x)).sum())} non-finite values")
    if not math.isfinite(max_abs(x) / w):  # in float64, as z = x / w is checked element by element
        raise CheckpointError(f"checkpoint {source}: the de-biased model x / w overflows (w = {w!r})")
    for name, buf in state["buffers"].items():
        if not all_finite(buf):
            raise CheckpointError(f"checkpoint {source}: buffer {name} holds non-finite values")


def snapshot(peer: Peer, round_index: int, spec: dict[str, Any], fingerprint: str,
             info: dict[str, Any] | None = None) -> dict[str, Any]:
    """A consistent copy of everything a restart needs (tensors cloned under the peer's lock, no I/O)."""
    with peer.lock:
        return {
            "schema": SCHEMA, "fingerprint": fingerprint, "peer_id": peer.peer_id, "round": round_index,
            "steps": peer.steps, "engine": _clone(peer.engine.state_dict()),
            "optimizer": _clone(peer.optimizer.state_dict()),
            "buffers": _clone(dict(peer.model.named_buffers())), "spec": spec,
            "recovery": peer.recovery.state_dict(), "info": dict(info or {}),
        }


def save(peer: Peer, path: Path, round_index: int, spec: dict[str, Any], fingerprint: str,
         previous: Path | None = None, info: dict[str, Any] | None = None) -> Path:
    """Snapshot under the lock, check it, write outside it (keeping the old file at ``previous`` when given).

    Raises:
        CheckpointError: the snapshot is not sane (:func:`check_sane`); nothing was written.
        OSError: the write failed (disk full, I/O error); the files are as they were.
    """
    state = snapshot(peer, round_index, spec, fingerprint, info)
    check_sane(state, f"{path} (not written)", peer.engine.max_peers)
    return save_atomic(state, path, previous)


def remove_stale_temps(path: Path) -> list[Path]:
    """Delete temporary files an interrupted :func:`save_atomic` of ``path`` left behind; returns them."""
    stale = sorted(path.parent.glob(f".{path.name}.*.tmp"))
    for tmp in stale:
        tmp.unlink(missing_ok=True)
    return stale


def load_newest(path: Path, previous: Path, fingerprint: str | None = None,
                max_weight: float | None = None) -> tuple[dict[str, Any], Path, list[str]]:
    """The newest readable checkpoint of ``path`` and ``previous``: (state, the file used, why others failed).

    Raises:
        CheckpointError: neither exists or neither is readable (the message names both files and reasons).
    """
    problems: list[str] = []
    for candidate in (path, previous):
        if not candidate.exists():
            continue
        try:
            return load(candidate, fingerprint, max_weight), candidate, problems
        except CheckpointError as exc:
            problems.append(str(exc))
    raise CheckpointError("; ".join(problems) or f"checkpoint {path}: not found")


def load(path: str | Path, fingerprint: str | None = None, max_weight: float | None = None) -> dict[str, Any]:
    """Load and check a checkpoint (schema, fingerprint when given, required keys; with ``max_weight`` also
    :func:`check_sane`)."""
    source = Path(path)
    try:
        state = torch.load(source, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {source}: not found") from None
    except Exception as exc:  # noqa: BLE001 - torch.load raises many types for corrupt or hostile files
        raise CheckpointError(f"checkpoint {source}: unreadable ({type(exc).__name__}: {exc})") from None
    if not isinstance(state, dict) or state.get("schema") != SCHEMA:
        found = state.get("schema") if isinstance(state, dict) else type(state).__name__
        raise CheckpointError(f"checkpoint {source}: schema {found!r}, this version reads schema {SCHEMA}")
    if fingerprint is not None and state.get("fingerprint") != fingerprint:
        raise CheckpointError(f"checkpoint {source}: model fingerprint {state.get('fingerprint')} differs from "
                              f"this model's {fingerprint}")
    missing = {"engine", "optimizer", "buffers", "steps", "round"} - set(state)
    if missing:
        raise CheckpointError(f"checkpoint {source}: missing {', '.join(sorted(missing))}")
    if max_weight is not None:
        check_sane(state, source, max_weight)
    return state


def restore(peer: Peer, state: dict[str, Any]) -> int:
    """Put a peer back exactly where the checkpoint left it (model buffers included); returns its round."""
    with peer.lock:
        peer.engine.load_state_dict(state["engine"])
        peer.optimizer.load_state_dict(state["optimizer"])
        peer.steps = int(state["steps"])
        peer.recovery.load_state_dict(state.get("recovery", {}))
        peer.engine.gamma = peer.recovery.gamma  # the configured gamma, halved as often as before
        load_buffers(peer.model, state["buffers"])
        peer.engine.state.debias_into(peer.flat.z)
    return int(state["round"])


def roll_back(peer: Peer, state: dict[str, Any]) -> None:
    """Return a diverged peer's model to the checkpoint's z, keeping its current weight and edges (mass moved
    since the checkpoint stays accounted for: x := z_checkpoint * w_now), momentum cleared."""
    peer.roll_back_to(debiased(state), state["buffers"])


def debiased(state: dict[str, Any], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The de-biased model z = x / w a checkpoint holds, computed in ``dtype``."""
    x: torch.Tensor = state["engine"]["x"]
    return x.to(dtype) / float(state["engine"]["w"])


def engine_of(state: dict[str, Any]) -> GossipEngine:
    """The gossip engine a checkpoint holds, rebuilt by the engine's own code (x, w, ledgers, in-flight records,
    the algorithm's state), on the CPU: what reads in-flight mass from files asks the engine, never the raw fields."""
    return GossipEngine.from_state_dict(state["peer_id"], state["engine"], torch.device("cpu"))


def load_buffers(model: nn.Module, buffers: dict[str, torch.Tensor]) -> None:
    """Copy saved buffers (activation ranges) into a model; names it does not have are ignored."""
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name in buffers:
                buf.copy_(buffers[name])


def average_buffers(buffer_sets: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Mean of the floating buffers (activation ranges) over peers; other buffers (flags) from the first."""
    out = {}
    for name, first in buffer_sets[0].items():
        out[name] = (torch.stack([b[name] for b in buffer_sets]).mean(dim=0) if first.is_floating_point()
                     else first)
    return out


def average_model(zs: Sequence[torch.Tensor]) -> torch.Tensor:
    """z_bar = mean_i z_i: the averaged model the paper evaluates (docs/method.md#measurements)."""
    return torch.stack(list(zs)).mean(dim=0)


def consensus_distance(zs: Sequence[torch.Tensor], dtype: torch.dtype = torch.float32) -> float:
    """mean_i ||z_i - z_bar|| (docs/method.md#measurements): an absolute L2 distance in parameter units, 0 at
    consensus, computed in ``dtype`` (float64 where a conservation check compares it with ~1e-7 of a norm)."""
    stacked = torch.stack([z.to(dtype) for z in zs])
    return float((stacked - stacked.mean(dim=0)).norm(dim=1).mean())


def _clone(obj: Any) -> Any:
    """Deep-copy tensors so a checkpoint written outside the lock is a consistent snapshot."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_clone(v) for v in obj)
    return obj

"""Where an exported model comes from: a state directory's checkpoint, the average of a fleet run's checkpoints, or
a remote peer's live model (GetModel).

Each gives a :class:`Trained`: the de-biased model z = x / w (flat fp32, layout order), the buffers it runs with,
and what the checkpoint says about it (RunSpec, ``info``: source, classes, input shape, normalisation). A remote
peer serves z only, so its architecture, buffers and ``info`` come from a local checkpoint of the same model (the
fingerprint is checked by the peer). Nothing here loads the training data.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from peer.config import RUN_SECTIONS, ConfigError, RunSpec, merge_sections
from peer.daemon.paths import CHECKPOINT_NAME, PREVIOUS_CHECKPOINT_NAME
from peer.export.errors import ExportError
from peer.models.plugin import DataShape
from peer.runtime import state

#: The fleet report's file in a run directory (peer/fleet/report.py write_summary): the averaged model's accuracy.
SUMMARY_NAME = "summary.json"
#: Seconds a remote peer gets to answer Status and to stream its model.
REMOTE_TIMEOUT_S = 60.0


@dataclass
class Trained:
    """A trained model as checkpoints (or a peer) hold it.

    Attributes:
        spec: the run it was trained with (model section: source, norm, precision, groups).
        info: the checkpoint's ``info``: source, source_kind, dataset, num_classes, input_shape [C, H, W], mean,
            std, classes, input_scale.
        z: the de-biased model, flat fp32 in layout (named_parameters) order.
        buffers: the model's buffers by name (norm statistics; activation ranges of 8-bit layers).
        fingerprint: the model fingerprint peers agree on.
        round: the gossip round of the checkpoint (the highest one for an average; None if unknown).
        test_acc: the peer's last test accuracy in [0, 1] (the fleet report's for an average; None if unknown).
        origin: where it came from (``kind``: checkpoint, average or remote, and the paths / address).
    """

    spec: RunSpec
    info: dict[str, Any]
    z: torch.Tensor
    buffers: dict[str, torch.Tensor]
    fingerprint: str
    round: int | None
    test_acc: float | None
    origin: dict[str, Any] = field(default_factory=dict)

    @property
    def data(self) -> DataShape:
        """The data shape the model was built for, from ``info`` (the inverse of DataShape.as_dict)."""
        return DataShape.from_dict(self.info)


def checkpoint_files(path: Path) -> list[Path]:
    """The state directories under ``path``: itself if it holds a checkpoint, else each subdirectory that does (a
    fleet run directory's ``peer-<i>``), sorted.

    Raises:
        ExportError: ``path`` is missing or holds no checkpoint at either level.
    """
    if not path.exists():
        raise ExportError(f"{path}: no such state or run directory")
    if not path.is_dir():
        raise ExportError(f"{path}: not a directory (give a state directory or a fleet run directory)")
    if _has_checkpoint(path):
        return [path]
    peers = sorted(p for p in path.iterdir() if p.is_dir() and _has_checkpoint(p))
    if not peers:
        raise ExportError(f"{path}: no {CHECKPOINT_NAME} in it nor in any subdirectory (a state directory or a "
                          f"fleet run directory)")
    return peers


def _has_checkpoint(state_dir: Path) -> bool:
    return (state_dir / CHECKPOINT_NAME).is_file() or (state_dir / PREVIOUS_CHECKPOINT_NAME).is_file()


def _load(state_dir: Path) -> tuple[dict[str, Any], Path]:
    """The newest readable checkpoint of a state directory, checked for the fields an export needs."""
    try:
        ckpt, used, _ = state.load_newest(state_dir / CHECKPOINT_NAME, state_dir / PREVIOUS_CHECKPOINT_NAME)
    except state.CheckpointError as exc:
        raise ExportError(str(exc)) from None
    info = ckpt.get("info") or {}
    missing = sorted({"num_classes", "input_shape"} - set(info))
    if missing or "spec" not in ckpt:
        raise ExportError(f"checkpoint {used}: holds no model info ({', '.join(missing) or 'spec'}); it was written "
                          f"before export existed - run the peer again to write a new one")
    return ckpt, used


def run_spec(plain: dict[str, Any], where: Path) -> RunSpec:
    """The RunSpec a checkpoint keeps as plain data (``asdict``), validated as a config file would be."""
    try:
        return RunSpec(**merge_sections([plain], RUN_SECTIONS))
    except ConfigError as exc:
        raise ExportError(f"checkpoint {where}: its spec is not one this version reads ({exc})") from None


def from_checkpoint(state_dir: Path) -> Trained:
    """The model of one state directory (its newest readable checkpoint)."""
    ckpt, used = _load(state_dir)
    return Trained(run_spec(ckpt["spec"], used), dict(ckpt["info"]), state.debiased(ckpt), ckpt["buffers"],
                   ckpt["fingerprint"], int(ckpt["round"]), ckpt["info"].get("test_acc"),
                   {"kind": "checkpoint", "checkpoint": str(used), "peer_id": ckpt.get("peer_id")})


def from_run_dir(run_dir: Path, state_dirs: list[Path], test_acc: float | None = None) -> Trained:
    """The averaged model of several state directories: z_bar = mean_i z_i with mean floating buffers
    (state.average_model / average_buffers, the fleet report's definition).

    ``test_acc``: the averaged model's accuracy where the caller has it; else the fleet report's
    (``summary.json`` ``averaged_model_acc``) if the run directory holds one, else None.
    """
    loaded = [_load(d) for d in state_dirs]
    first, first_path = loaded[0]
    for ckpt, used in loaded[1:]:
        if ckpt["fingerprint"] != first["fingerprint"]:
            raise ExportError(f"checkpoint {used}: model fingerprint {ckpt['fingerprint']} differs from "
                              f"{first_path}'s {first['fingerprint']}: not one fleet's models, no average")
    z_bar = state.average_model([state.debiased(c) for c, _ in loaded])
    buffers = state.average_buffers([c["buffers"] for c, _ in loaded])
    if test_acc is None:
        test_acc = _report_accuracy(run_dir)
    return Trained(run_spec(first["spec"], first_path), dict(first["info"]), z_bar, buffers, first["fingerprint"],
                   max(int(c["round"]) for c, _ in loaded), test_acc,
                   {"kind": "average", "run_dir": str(run_dir),
                    "peers": {str(c.get("peer_id")): {"checkpoint": str(p), "round": int(c["round"])}
                              for c, p in loaded}})


def _report_accuracy(run_dir: Path) -> float | None:
    try:
        value = json.loads((run_dir / SUMMARY_NAME).read_text()).get("averaged_model_acc")
    except (OSError, ValueError, AttributeError):
        return None
    return float(value) if isinstance(value, (int, float)) else None


def from_remote(reference: Path, address: str, tls_dir: Path | None, timeout_s: float = REMOTE_TIMEOUT_S) -> Trained:
    """A remote peer's live de-biased model (GetModel), with its round and last test accuracy (Status).

    ``reference``: a state directory holding a checkpoint of the same model (architecture, buffers, ``info``); the
    peer refuses a request whose fingerprint is not its own. ``tls_dir``: the caller's TLS directory (an operator
    certificate, ``lpdl-peer ca issue --operator``); None = insecure (only a peer started with --insecure answers).
    """
    ckpt, used = _load(reference)
    numel = int(ckpt["engine"]["x"].numel())
    status, data = asyncio.run(_pull(address, ckpt["fingerprint"], tls_dir, timeout_s))
    from peer.net.api import model_from_bytes

    try:
        z = model_from_bytes(data, numel)
    except ValueError as exc:
        raise ExportError(f"peer {address}: {exc}") from None
    evaluation = status.get("eval") or {}
    return Trained(run_spec(ckpt["spec"], used), dict(ckpt["info"]), z, ckpt["buffers"], ckpt["fingerprint"],
                   status.get("round"), evaluation.get("test_acc"),
                   {"kind": "remote", "peer": address, "peer_id": status.get("peer_id"),
                    "architecture_and_buffers": str(used)})


async def _pull(address: str, fingerprint: str, tls_dir: Path | None,
                timeout_s: float) -> tuple[dict[str, Any], bytes]:
    """(status document, model bytes) of the peer at ``address``; every failure is one ExportError line."""
    import grpc

    from peer.net.client import describe_rpc_error, fetch_model
    from peer.net.proto.lpdl.v1 import peer_pb2 as pb
    from peer.net.proto.lpdl.v1 import peer_pb2_grpc
    from peer.security.credentials import TlsConfigError, TransportSecurity, Unauthenticated

    try:
        security = TransportSecurity.for_holder(tls_dir) if tls_dir else TransportSecurity.insecure()
    except TlsConfigError as exc:
        raise ExportError(str(exc)) from None
    who = security.identity.uri if security.identity else "no certificate (insecure)"
    try:
        async with security.channel(address, []) as channel:
            reply = await peer_pb2_grpc.PeerStub(channel).Status(pb.StatusRequest(), timeout=timeout_s)
        data = await asyncio.wait_for(fetch_model(address, fingerprint, security=security), timeout_s)
    except (grpc.RpcError, Unauthenticated, asyncio.TimeoutError) as exc:
        hint = "" if tls_dir else " - a secured peer needs --tls-dir with an operator certificate"
        text = "no answer" if isinstance(exc, asyncio.TimeoutError) else describe_rpc_error(exc)
        raise ExportError(f"peer {address} refused or did not answer the model request as {who}: "
                          f"{' '.join(text.split())}{hint}") from None
    except ValueError as exc:
        raise ExportError(str(exc)) from None
    return json.loads(reply.json), data

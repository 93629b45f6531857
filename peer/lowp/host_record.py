"""What the int8 probes measured on this host, kept on disk so that N daemons on one host - and every restart -
pay each probe once (issue 21; docs/decisions/lowp-passes.md#one-probe-per-host).

The kernel probe (plan.py) checks every int8 kernel for exactness on full-range operands of each layer shape and
times it against fp32, and the step check (steptime.py) times a whole training step against an fp32 twin. Both
depend only on the CPU (or GPU), torch and the probing code (the step check also on the thread count) - not on the
model's weights or the data - so every daemon of a host reached the same verdicts, each at a cost: in a profiled
4-peer int8 simulator run on 2 cores the 18 probes took 25.8 s of the 55 s spent in rounds (the fp64 reference
products of the exactness check 20 s of it), and in bench/fleet.py's memory stages the model stage (probes and step
check) added 26 MiB to a daemon on a cold record and none on a warm one.

A record is one small JSON file per verdict under a directory named after the host's identity: CPU flags and model
name (or the GPU's name), torch version and a digest of the probing code's source, so a record is never read on
another CPU, torch or code version (a step check's own key holds the thread count and the model). Each verdict is
made under a host-wide lock (host_lock.py): of N processes starting together, one probes and the others wait and
read its verdict. A file that cannot be read or does not hold a valid verdict is probed again and overwritten (one
log line); a directory that cannot be written leaves the probes as they were, per process (one warning).

Where: ``$LPDL_CACHE_DIR``, else systemd's ``$CACHE_DIRECTORY`` (the unit's CacheDirectory=), else
``$XDG_CACHE_HOME/lpdl-peer``, else ``~/.cache/lpdl-peer``; ``LPDL_CACHE_DIR=off`` turns the record off.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import platform
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from peer.lowp.compiler_env import cpu_flags, cpuinfo_field
from peer.lowp.host_lock import host_lock

log = logging.getLogger(__name__)

CACHE_ENV = "LPDL_CACHE_DIR"
#: ``LPDL_CACHE_DIR`` value that turns the record off (every process probes for itself).
OFF = "off"
#: Seconds a process waits for another one's probe of the same verdict before probing itself (a probe takes
#: 0.1-3 s; a holder that died releases its lock at once).
PROBE_WAIT_S = 120.0
#: The modules whose code decides a verdict: a change to any of them starts a new record.
_PROBING_CODE = ("kernels.py", "probe.py", "plan.py", "steptime.py", "qmath.py", "layers.py", "evonorm.py",
                 "passes.py", "graphs.py", "compiler_env.py", "torch_patches.py")


def cache_root() -> Path | None:
    """The directory records live under (module docstring), or None when turned off."""
    chosen = os.environ.get(CACHE_ENV, "").strip()
    if chosen.lower() == OFF:
        return None
    if chosen:
        return Path(chosen)
    if os.environ.get("CACHE_DIRECTORY"):  # systemd: the first of the unit's CacheDirectory= entries
        return Path(os.environ["CACHE_DIRECTORY"].split(":")[0])
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "lpdl-peer"


def _code_digest() -> str:
    here = Path(__file__).parent
    digest = hashlib.sha256()
    for name in _PROBING_CODE:
        digest.update((here / name).read_bytes())
    return digest.hexdigest()[:16]


def host_identity(device: torch.device) -> str:
    """What a verdict depends on besides its own key, as one line (hashed into the record's directory name)."""
    if device.type == "cuda":
        hardware = f"cuda {torch.cuda.get_device_name(device)} {torch.version.cuda}"
    else:
        model = cpuinfo_field(("model name", "CPU part"))
        hardware = f"cpu {platform.machine()} {model} {cpu_flags()}"
    return f"{hardware} | torch {torch.__version__} | code {_code_digest()}"


@dataclass
class Slot:
    """One verdict of the record while its lock is held: ``value`` as read (None: not there yet, or unreadable),
    :meth:`save` to store a new one."""

    path: Path | None
    key: str
    value: dict[str, Any] | None

    def save(self, value: dict[str, Any]) -> None:
        """Write ``value`` (with the key, which reading checks) atomically: a reader never sees half a file. A failed
        write is logged, not raised."""
        self.value = value
        if self.path is None:
            return
        try:
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".tmp-")
            with os.fdopen(fd, "w") as f:
                json.dump({**value, "key": self.key}, f)
            os.replace(tmp, self.path)
        except OSError as exc:
            log.warning("probe record %s not written (%s): the next process probes again", self.path, exc)


class HostRecord:
    """The verdicts of one host identity (module docstring); ``directory`` None keeps nothing (a record that was
    turned off or could not be made)."""

    def __init__(self, directory: Path | None) -> None:
        self.directory = directory

    @classmethod
    def for_device(cls, device: torch.device) -> HostRecord:
        """This host's record for ``device``, under :func:`cache_root`."""
        root = cache_root()
        if root is None:
            return cls(None)
        identity = host_identity(torch.device(device))
        directory = root / "probes" / hashlib.sha256(identity.encode()).hexdigest()[:16]
        try:
            directory.mkdir(parents=True, exist_ok=True)
            about = directory / "host.txt"
            if not about.exists():
                about.write_text(identity + "\n")
        except OSError as exc:
            log.warning("probe record unavailable at %s (%s): each process probes for itself", directory, exc)
            return cls(None)
        return cls(directory)

    @property
    def enabled(self) -> bool:
        return self.directory is not None

    @contextlib.contextmanager
    def slot(self, key: str) -> Iterator[Slot]:
        """The verdict named ``key``, with the host-wide lock on it held: a caller that finds ``value`` None
        probes and saves, while other processes asking for the same key wait."""
        if self.directory is None:
            yield Slot(None, key, None)
            return
        path = self._path(self.directory, key)
        with host_lock(self.directory / "locks" / f"{path.stem}.lock", PROBE_WAIT_S, f"probe {key}"):
            yield Slot(path, key, self._read(path, key))

    def peek(self, key: str) -> dict[str, Any] | None:
        """The verdict named ``key`` without taking its lock (files are replaced whole, so a reader sees the old
        verdict or the new one); None where there is none yet."""
        return None if self.directory is None else self._read(self._path(self.directory, key), key)

    @staticmethod
    def _path(directory: Path, key: str) -> Path:
        return directory / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"

    @staticmethod
    def _read(path: Path, key: str) -> dict[str, Any] | None:
        try:
            text = path.read_text()
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("probe record %s unreadable (%s): probing %s again", path, exc, key)
            return None
        try:
            value = json.loads(text)
        except ValueError:
            value = None
        if not isinstance(value, dict) or value.get("key") != key:
            log.warning("probe record %s does not hold a verdict for %s: probing again", path, key)
            return None
        return value

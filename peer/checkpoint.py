"""Atomic save / restore of peer state (DESIGN.md 1).

A checkpoint is written to a temporary file in the same directory, fsynced, then renamed over the old one, so a
crash or power cut (common on edge devices) leaves either the old or the new checkpoint, never a torn one.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch


class CheckpointError(RuntimeError):
    """A checkpoint is missing, unreadable or for another model; the message names the file."""


def save_atomic(obj: Any, path: str | Path) -> Path:
    """torch.save ``obj`` to ``path`` atomically; returns the path."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save(obj, fh)
            fh.flush()
            os.fsync(fh.fileno())
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


def load(path: str | Path, expected_fingerprint: str | None = None) -> dict[str, Any]:
    """Load a checkpoint dict; refuse one whose ``fingerprint`` differs from the expected model's."""
    source = Path(path)
    try:
        obj = torch.load(source, map_location="cpu", weights_only=False)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {source}: not found") from None
    except Exception as exc:  # torch.load raises many types for corrupt files
        raise CheckpointError(f"checkpoint {source}: unreadable ({exc})") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"checkpoint {source}: expected a dict, got {type(obj).__name__}")
    found = obj.get("fingerprint")
    if expected_fingerprint is not None and found != expected_fingerprint:
        raise CheckpointError(f"checkpoint {source}: model fingerprint {found} differs from this model's "
                              f"{expected_fingerprint}")
    return obj

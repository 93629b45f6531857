"""Models: the hand-written 8-bit architectures (registry), the user's own models (source, plugin) and the
fingerprint peers compare.

Names load on first use, so importing ``peer.models.kinds`` (config, CLI) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {"available_models": "registry", "build_model": "registry", "model_fingerprint": "fingerprint"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)

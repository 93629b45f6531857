"""Compression of gossip updates: layer-wise top-k, k-bit values, coded indices, and the payload codec.

Pure tensor/bytes code: this package never imports the network, the node, or the gossip algorithms. Its names load
on first use, so importing ``peer.compress.kinds`` (config, CLI) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "CodecConfig": "codec", "Decoded": "codec", "decode": "codec", "encode": "codec",
    "PayloadError": "errors", "Layout": "layout", "Segment": "layout",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)

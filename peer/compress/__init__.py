"""Compression of gossip updates: layer-wise top-k, k-bit values, coded indices, and the payload codec.

Pure tensor/bytes code: this package never imports the network, the node, or the gossip algorithms.
"""

from .codec import CodecConfig, Decoded, decode, encode
from .errors import PayloadError
from .layout import Layout, Segment

__all__ = ["CodecConfig", "Decoded", "Layout", "PayloadError", "Segment", "decode", "encode"]

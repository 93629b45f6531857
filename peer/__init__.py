"""lpdl-peer: decentralized low-precision learning daemon for edge devices.

Package rooms (one concern each, see ../shared/DESIGN.md 1): lowp (8-bit training), models, data, gossip (push-sum
algorithms, pure tensor code), compress (top-k + int8 payload codec), net (gRPC, discovery), node (the daemon),
sim (many peers in one process), cli (one module per command).
"""

__version__ = "0.1.0"

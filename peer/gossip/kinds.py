"""Names the gossip room defines: algorithms and topologies (torch-free, so config and CLI can import them)."""

from __future__ import annotations

#: Gossip algorithms (docs/method.md#gossip-algorithms): dense push-sum, Deep-Squeeze with push-sum, Choco-SGD with
#: push-sum.
ALGORITHMS = ("sgp", "deepsqueeze", "choco")
#: Topology schedules over the sorted live peer ids (peer/gossip/topology.py).
TOPOLOGIES = ("ring", "undirected-ring", "torus", "exponential", "random")

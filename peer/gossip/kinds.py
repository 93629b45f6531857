"""Names the gossip room defines: algorithms and topologies (torch-free, so config and CLI can import them)."""

from __future__ import annotations

import enum


class Algorithm(str, enum.Enum):
    """Gossip algorithms (docs/method.md#gossip-algorithms): dense push-sum, Deep-Squeeze with push-sum, Choco-SGD
    with push-sum. A str enum: each member equals, prints and serialises as its name, so TOML files, CLI choices,
    checkpoints and the wire keep the strings."""

    SGP = "sgp"
    DEEPSQUEEZE = "deepsqueeze"
    CHOCO = "choco"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, name: str) -> Algorithm:
        """The member named ``name``; ValueError naming the choices otherwise."""
        try:
            return cls(name)
        except ValueError:
            raise ValueError(f"algorithm: unknown {name!r}; choose one of {', '.join(ALGORITHMS)}") from None


#: The algorithms' names, in the order the CLI offers them.
ALGORITHMS = tuple(a.value for a in Algorithm)
#: Topology schedules over the sorted live peer ids (peer/gossip/topology.py).
TOPOLOGIES = ("ring", "undirected-ring", "torus", "exponential", "random")

"""Names the gossip room defines: algorithms, topologies and a peer's phases (torch-free, so config, CLI and the
daemon's metrics can import them)."""

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
class PhaseName(enum.Enum):
    """Where a peer is in its learning life (docs/method.md#the-consensus-phase; the status document shows it)."""

    TRAINING = "training"
    CONSENSUS = "consensus"
    CONVERGED = "converged"  # the final phase ended: the peer serves its neighbours and no longer sends


#: Topology schedules over the sorted live peer ids (peer/gossip/topology.py).
TOPOLOGIES = ("ring", "undirected-ring", "torus", "exponential", "random")

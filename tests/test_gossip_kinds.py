"""The Algorithm enum: members are their names wherever a string travels (TOML, CLI choices, checkpoints, the wire),
and the engine compares members, not strings."""

from __future__ import annotations

import io
import json

import pytest
import torch

from peer.gossip.kinds import ALGORITHMS, Algorithm
from tests.gossip_helpers import make_engines


def test_members_are_their_names_as_strings() -> None:
    assert ALGORITHMS == ("sgp", "deepsqueeze", "choco")
    for name in ALGORITHMS:
        member = Algorithm.parse(name)
        assert member == name and str(member) == name and f"{member}" == name and json.dumps(member) == f'"{name}"'
    with pytest.raises(ValueError, match="unknown 'push'; choose one of sgp, deepsqueeze, choco"):
        Algorithm.parse("push")


@pytest.mark.parametrize("name", ALGORITHMS)
def test_engine_runs_the_member_and_checkpoints_its_plain_name(name: str) -> None:
    engine = make_engines(1, name, compression=0.0)["p0"]
    assert engine.algorithm.name is Algorithm(name)
    assert engine.gamma == (1.0 if name == "sgp" else 0.5)  # sgp: gamma forced to 1
    state = engine.state_dict()
    assert type(state["algorithm"]) is str  # a weights-only loader reads it back
    buffer = io.BytesIO()
    torch.save({"algorithm": state["algorithm"]}, buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=True)["algorithm"] == name

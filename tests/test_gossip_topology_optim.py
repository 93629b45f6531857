"""Topologies (out-neighbour schedules, column-stochastic mixing, spectral gap) and the push-sum optimizer."""

import numpy as np
import pytest
import torch

from peer.gossip.optim import OptimConfig, PushSumSGD
from peer.gossip.reach import fewest_senders, max_insiders_bounded
from peer.gossip.topology import TOPOLOGIES, Topology, spectral_gap

IDS = [f"n{i}" for i in range(8)]


def test_directed_ring_static_and_rotating():
    ring = Topology("ring")
    assert ring.out_neighbours(IDS, "n0", 0) == ["n1"]
    assert ring.out_neighbours(IDS, "n7", 5) == ["n0"]
    rotating = Topology("ring", rotating=True)
    assert [rotating.out_neighbours(IDS, "n0", t) for t in range(3)] == [["n1"], ["n2"], ["n3"]]


def test_exponential_graph_hops_powers_of_two():
    assert Topology("exponential").out_neighbours(IDS, "n0", 0) == ["n1", "n2", "n4"]
    rotating = Topology("exponential", rotating=True)
    assert [rotating.out_neighbours(IDS, "n3", t) for t in range(4)] == [["n4"], ["n5"], ["n7"], ["n4"]]


def test_torus_has_four_neighbours_on_a_grid():
    out = Topology("torus").out_neighbours(IDS, "n0", 0)  # 8 peers -> 2 x 4 grid
    assert sorted(out) == ["n1", "n3", "n4"]  # up and down coincide on 2 rows


def test_random_k_out_is_deterministic_per_round_and_varies_when_rotating():
    topo = Topology("random", rotating=True, k=3, seed=7)
    first = topo.out_neighbours(IDS, "n2", 4)
    assert first == topo.out_neighbours(list(reversed(IDS)), "n2", 4)  # order of the live set does not matter
    assert len(first) == 3 and "n2" not in first
    assert any(topo.out_neighbours(IDS, "n2", t) != first for t in range(5, 15))


@pytest.mark.parametrize("kind", TOPOLOGIES)
@pytest.mark.parametrize("rotating", [False, True])
def test_mixing_matrices_are_column_stochastic(kind, rotating):
    w = Topology(kind, rotating=rotating, k=2).mixing_matrix(8, 3)
    assert np.allclose(w.sum(axis=0), 1.0) and (w >= 0).all()


def test_spectral_gap_orders_topologies_as_expected():
    ring = spectral_gap(Topology("ring"), 16)
    expo = spectral_gap(Topology("exponential"), 16)
    assert 0.0 < ring < expo <= 1.0


@pytest.mark.parametrize("kind", TOPOLOGIES)
@pytest.mark.parametrize("rotating", [False, True])
@pytest.mark.parametrize("n", [2, 5, 8])
def test_horizon_is_the_first_round_every_peer_has_heard_from_every_other(kind, rotating, n):
    """The product of the rounds' mixing matrices is positive everywhere after ``horizon`` rounds, not one before
    (a static random draw may leave a peer without in-neighbours: then never, and the horizon is the limit)."""
    topo = Topology(kind, rotating=rotating, k=2)
    limit = 64
    rounds = topo.horizon(n, limit)
    product = np.eye(n)
    for t in range(rounds):
        assert not (product > 0).all(), f"everyone heard from everyone after {t} < {rounds} rounds"
        product = topo.mixing_matrix(n, t) @ product
    assert (product > 0).all() == (rounds < limit)


def test_horizon_of_the_exponential_graph_is_log2_and_of_a_static_ring_n_minus_1():
    assert [Topology("exponential", rotating=True).horizon(n) for n in (1, 2, 4, 8, 16)] == [0, 1, 2, 3, 4]
    assert Topology("ring").horizon(8) == 7


def test_senders_within_a_period_are_the_in_neighbours():
    assert Topology("ring").senders_within_period(IDS, "n3", 5) == {"n2"}
    assert Topology("exponential", rotating=True).senders_within_period(IDS, "n3", 7) == {"n2", "n1", "n7"}
    assert Topology("undirected-ring").senders_within_period(IDS, "n0", 0) == {"n1", "n7"}


@pytest.mark.parametrize(("topology", "n", "fewest", "bounded"), [
    (Topology("ring"), 8, 1, 0), (Topology("undirected-ring"), 8, 2, 0),
    (Topology("exponential", rotating=True), 8, 3, 1), (Topology("exponential"), 5, 3, 1),
    (Topology("exponential", rotating=True), 4, 2, 0),
    (Topology("torus"), 8, 3, 1), (Topology("torus"), 12, 4, 1),
    (Topology("torus"), 11, 2, 0),  # a prime count is a 1 x n grid: a ring
    (Topology("ring", rotating=True), 8, 7, 2),  # all 7 others within its period; 3f + 1 <= 8 peers caps it at 2
])
def test_the_most_insiders_a_graph_lets_a_local_rule_bound(topology, n, fewest, bounded):
    """2f + 1 senders a period and 3f + 1 peers to bound f insiders within the honest spread (peer/gossip/reach.py)."""
    assert fewest_senders(topology, n) == fewest
    assert max_insiders_bounded(fewest, n) == bounded


def test_the_bound_needs_both_senders_and_peers():
    assert [max_insiders_bounded(s, 100) for s in range(8)] == [0, 0, 0, 1, 1, 2, 2, 3]
    assert [max_insiders_bounded(7, n) for n in (3, 4, 6, 7, 9, 10)] == [0, 1, 1, 2, 2, 3]


def test_live_set_changes_the_graph_without_coordination():
    ring = Topology("ring")
    assert ring.out_neighbours(["n0", "n1", "n2"], "n1", 0) == ["n2"]
    assert ring.out_neighbours(["n0", "n1"], "n1", 0) == ["n0"]  # n2 left
    assert ring.out_neighbours(["n1"], "n1", 0) == []


def test_invalid_topology_is_named():
    with pytest.raises(ValueError, match="topology"):
        Topology("star")


def test_step_moves_z_by_lr_times_direction_whatever_w():
    for w in (0.1, 1.0, 3.0):
        opt = PushSumSGD(4, OptimConfig(momentum=0.0, weight_decay=0.0))
        z = torch.tensor([1.0, 2.0, 3.0, 4.0])
        x = z * w
        opt.step(x, z, torch.ones(4), lr=0.5, w=w)
        assert torch.allclose(x / w, z - 0.5)


def test_nesterov_momentum_matches_torch_sgd():
    torch.manual_seed(0)
    z = torch.randn(5)
    grads = [torch.randn(5) for _ in range(3)]
    ref = z.clone().requires_grad_(True)
    sgd = torch.optim.SGD([ref], lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4)
    opt = PushSumSGD(5, OptimConfig(momentum=0.9, weight_decay=1e-4, nesterov=True))
    x = z.clone()
    for g in grads:
        ref.grad = g.clone()
        sgd.step()
        opt.step(x, x.clone(), g.clone(), lr=0.1, w=1.0)
    assert torch.allclose(x, ref.detach(), atol=1e-6)


def test_qgm_buffer_tracks_total_movement_including_gossip():
    opt = PushSumSGD(3, OptimConfig(momentum=0.9, weight_decay=0.0, qgm=True))
    z = torch.zeros(3)
    x = z.clone()
    opt.step(x, z, torch.zeros(3), lr=0.1, w=1.0)  # no gradient: the local step moves nothing
    gossiped = torch.tensor([0.0, -1.0, 2.0])      # but gossip moved the model
    opt.after_gossip(gossiped, lr=0.1)
    assert torch.allclose(opt.buf, (1 - 0.9) * (z - gossiped) / 0.1)

"""The most subtle insiders a fleet's graph lets any rule local to a peer bound
(docs/design.md#what-a-graph-lets-the-rule-bound). Pure: the callers pass the senders the schedule has.

An insider whose messages stay within the honest peers' spread ("a little is enough": a consistent shift of about
one standard deviation of the honest models) looks like an honest neighbour to the peer that hears it. A rule that
sees only its own neighbours' messages cannot tell which of two disagreeing neighbours is the insider, and a peer
that hears one neighbour takes what it is told. Iterative approximate Byzantine consensus - each peer updating from
its in-neighbours' values alone, as gossip does - is possible only where every peer has at least ``2 f + 1``
in-neighbours and the fleet at least ``3 f + 1`` peers, to bound ``f`` insiders (Vaidya, Tseng and Liang, PODC 2012,
on arbitrary directed graphs). That is a necessary condition, not a guarantee of this project's rule: a peer can
bound at most ``min((senders - 1) // 2, (peers - 1) // 3)`` such insiders. None on a static directed ring (1 sender)
or undirected ring (2); one on the exponential graph from 5 peers (3 senders: within one period of 3 rounds where it
rotates). A rotating graph is counted by the senders of one period, as the rule's outlier references are
(:meth:`~peer.gossip.topology.Topology.senders_within_period`): a rotating ring of 8 hears all 7 others in 7 rounds.

Measured (docs/RESULTS.md#byzantine-robust-gossip-issue-23, 8 peers, dense SGP at skew 0.8): the "alie" insider
took the undirected ring's honest averaged model 10.8 points below the clean fleet with one insider and 35.5 with
two, and the rotating exponential graph's 0.5 and 0.3. Gross insiders (an implausible model, a weight claim,
non-finite values) are quarantined on any graph: this figure is about the subtle ones only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: `lpdl-peer status` loads this module without numpy
    from peer.gossip.topology import Topology


def max_insiders_bounded(senders: int, peers: int) -> int:
    """The most insiders within the honest spread a peer that hears ``senders`` distinct peers (within one period
    of the graph, quarantined ones not counted) in a fleet of ``peers`` (itself included) can bound: the largest
    ``f`` with ``2 f + 1 <= senders`` and ``3 f + 1 <= peers``."""
    return max(0, min((senders - 1) // 2, (peers - 1) // 3))


def fewest_senders(topology: Topology, n: int) -> int:
    """The fewest distinct senders any of ``n`` peers, all live, hears within one period of ``topology``."""
    ids = [f"{i:06d}" for i in range(n)]
    return min((len(topology.senders_within_period(ids, me, 0)) for me in ids), default=0)


def describe(senders: int, bounded: int) -> str:
    """One line for the log, the status view and the simulator's header: what hearing ``senders`` distinct peers a
    period of the graph lets a peer bound (``bounded``: :func:`max_insiders_bounded`). ``senders`` 0 is a peer
    whose every scheduled sender is quarantined (the callers say nothing while none is scheduled)."""
    if senders == 0:
        return "hears no peer a period of the graph: every peer scheduled to send here is quarantined"
    heard = f"hears {senders} peer{'' if senders == 1 else 's'} a period of the graph"
    if bounded == 0:
        return (f"{heard}: no local rule can bound an insider that stays within the honest spread "
                "(3 senders needed for one: a denser gossip.topology); gross ones are quarantined")
    return (f"{heard}: at most {bounded} insider{'' if bounded == 1 else 's'} within the honest spread can be "
            "bounded; gross ones are quarantined")

"""How many subtle insiders a fleet's graph lets a peer's receive rule bound
(docs/design.md#what-a-graph-lets-the-rule-bound). Pure: the callers pass the senders the schedule has.

An insider whose messages stay within the honest peers' spread ("a little is enough": a consistent shift of about
one standard deviation of the honest models) looks like an honest neighbour to the peer that hears it. A rule that
sees only its own neighbours' messages cannot tell which of two disagreeing neighbours is the insider, and a peer
that hears one neighbour takes what it is told. Iterative approximate Byzantine consensus - each peer updating from
its in-neighbours' values alone, as gossip does - is possible only where every peer has at least ``2 f + 1``
in-neighbours to bound ``f`` insiders (Vaidya, Tseng and Liang, PODC 2012, on arbitrary directed graphs). So a peer
bounds ``(senders - 1) // 2`` such insiders: none on a directed ring (1 sender) or an undirected ring (2), one on the
rotating exponential graph of 8 (3 senders within its period of 3 rounds) or a torus of 9 and more (4).

Measured (docs/RESULTS.md#byzantine-robust-gossip-issue-23, 8 peers, dense SGP at skew 0.8): the "alie" insider
took the undirected ring's honest averaged model 10.8 points below the clean fleet with one insider and 35.5 with
two, and the rotating exponential graph's 0.5 and 0.3. Gross insiders (an implausible model, a weight claim,
non-finite values) are quarantined on any graph: this figure is about the subtle ones only.
"""

from __future__ import annotations

from peer.gossip.topology import Topology


def insiders_bounded(senders: int) -> int:
    """Insiders within the honest spread a peer that hears ``senders`` distinct peers (within one period of the
    graph, quarantined ones not counted) can bound: ``f`` such that ``2 f + 1 <= senders``."""
    return max(0, (senders - 1) // 2)


def senders_needed(insiders: int) -> int:
    """Distinct senders a peer must hear to bound ``insiders`` insiders within the honest spread: ``2 f + 1``."""
    return 2 * insiders + 1


def fewest_senders(topology: Topology, n: int) -> int:
    """The fewest distinct senders any of ``n`` peers, all live, hears within one period of ``topology``."""
    ids = [f"{i:06d}" for i in range(n)]
    return min((len(topology.senders_within_period(ids, me, 0)) for me in ids), default=0)


def describe(senders: int) -> str:
    """One line for a log or a header: what ``senders`` distinct senders a period let the robust rule bound."""
    bounded = insiders_bounded(senders)
    heard = f"hears {senders} peer{'' if senders == 1 else 's'} a period of the graph"
    if bounded == 0:
        return (f"{heard}: the robust rule bounds no insider within the honest spread ({senders_needed(1)} senders "
                "needed for one: a denser gossip.topology); gross ones are quarantined")
    return f"{heard}: the robust rule bounds {bounded} insider{'' if bounded == 1 else 's'} within the honest spread"

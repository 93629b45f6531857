"""The status document's typed form: what a daemon writes (to_json) its readers parse back (from_json) unchanged,
and a document that is not one is refused naming the field."""

from __future__ import annotations

import json
import math

import pytest

from peer.daemon.kinds import Phase
from peer.daemon.status import EvalResult, StatusDocument, StatusFormatError
from peer.net.accounting import LinkCounters
from peer.net.snapshots import EdgeSnapshot, ServerSnapshot
from tests.status_helpers import neighbour_json, status_json
from tests.test_cli_status import snapshot


def test_document_round_trips_through_its_json() -> None:
    doc = StatusDocument.from_json(status_json(
        round=7, loss=0.25, eval={"round": 6, "epoch": 0.5, "test_loss": 0.4, "test_acc": 0.875},
        neighbours={"p1": neighbour_json(bytes_sent=123, rtt_s=0.01, settled={"delivered": 2},
                                         certificate_serial="5f3a09c2e1")},
        refused={"fingerprint": 3},
        gossip={"algorithm": "sgp", "compression": 0.0, "bits": 8, "gamma": 1.0, "configured_gamma": 1.0,
                "topology": "undirected-ring", "window": 32, "robust": True, "senders": 2, "max_insiders": 0},
        memory={"rss_mib": 700.0, "peak_mib": 750.0, "after": {"imports": 500.0}, "added": {"imports": 500.0},
                "gossip_state_mib": 9.5, "allocator": "tcmalloc"}))
    assert doc.phase is Phase.TRAINING and doc.eval == EvalResult(6, 0.5, 0.4, 0.875)
    assert doc.neighbours["p1"].bytes_sent == 123 and doc.neighbours["p1"].settled == {"delivered": 2}
    assert doc.neighbours["p1"].certificate_serial == "5f3a09c2e1"
    assert doc.memory is not None and doc.memory.allocator == "tcmalloc"
    assert (doc.gossip.robust, doc.gossip.senders, doc.gossip.max_insiders) == (True, 2, 0)
    wire = json.loads(json.dumps(doc.to_json()))  # what the control socket and the Status RPC carry
    assert StatusDocument.from_json(wire) == doc


def test_an_older_daemons_document_takes_the_defaults() -> None:
    """The 8-neighbour LAN document of the cli test lacks the fields added since (window, in_flight, ...)."""
    doc = StatusDocument.from_json(snapshot())
    assert doc.gossip.window == 1 and doc.gossip.configured_gamma == doc.gossip.gamma
    assert all(n.in_flight == 0 and n.certificate_serial is None for n in doc.neighbours.values())
    assert doc.divergences == 0
    assert (doc.gossip.robust, doc.gossip.senders, doc.gossip.max_insiders) == (None, None, None)
    no_loss = StatusDocument.from_json(status_json(loss=None, eval={}))
    assert math.isnan(no_loss.loss) and no_loss.eval is None and no_loss.memory is None


@pytest.mark.parametrize(("change", "names"), [
    ({"round": "7"}, "round is str, not int"),
    ({"phase": "dancing"}, "unknown phase 'dancing'"),
    ({"gossip": {"algorithm": "choco", "compression": 0.9, "bits": 8, "gamma": 0.1}}, "gossip.topology is missing"),
    ({"gossip": {"algorithm": "sgp", "compression": 0.0, "bits": 8, "gamma": 1.0, "topology": "ring",
                 "senders": "1"}}, "gossip.senders is str, not int"),
    ({"neighbours": {"p1": {"state": "active"}}}, "neighbour.bytes_sent is missing"),
    ({"neighbours": {"p1": neighbour_json(certificate_serial=12)}}, "neighbour.certificate_serial is int, not str"),
])
def test_a_malformed_document_is_refused_naming_the_field(change: dict[str, object], names: str) -> None:
    with pytest.raises(StatusFormatError, match=names):
        StatusDocument.from_json(status_json(**change))
    with pytest.raises(StatusFormatError, match="expected a JSON object"):
        StatusDocument.from_json([1, 2])  # type: ignore[arg-type]


def test_transport_snapshots_round_trip_through_their_json() -> None:
    edge = EdgeSnapshot(receiver="p1", address="10.0.0.2:7070", state="active", hello_rtt_s=0.004, ack_rtt_s=None,
                        last_seen=1.7e9, bytes_sent=1234, bytes_received=56, delivered=7, batched=3,
                        settled={"delivered": 6, "retracted": 1}, handshakes=2, last_error="")
    server = ServerSnapshot(links={"p1": LinkCounters(bytes_sent=9, bytes_received=10, frames_sent=1,
                                                      frames_received=2, last_seen=1.7e9)},
                            refused={"fingerprint": 1}, applied=5, inbound_streams=["p1"], buffered_bytes=64,
                            tls=True, certificate_serials={"p1": "5f3a09c2e1"})
    assert EdgeSnapshot.from_json(json.loads(json.dumps(edge.to_json()))) == edge
    assert ServerSnapshot.from_json(json.loads(json.dumps(server.to_json()))) == server

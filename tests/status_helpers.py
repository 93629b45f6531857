"""A whole status document for the readers' tests (fleet table, report, plots), with the fields a test cares about
given and the rest at a freshly started daemon's values."""

from __future__ import annotations

from typing import Any

from peer.daemon.status import StatusDocument


def status_json(**fields: Any) -> dict[str, Any]:
    """The JSON a daemon's control socket serves; ``fields`` replace top-level entries."""
    doc: dict[str, Any] = {
        "peer_id": "p0", "fleet": "fl-x", "phase": "training", "uptime_s": 1.0, "round": 0, "epoch": 0.0,
        "lr": 0.1, "loss": float("nan"), "eval": {}, "w": 1.0,
        "precision": {"requested": "fp32", "backend": "fp32", "reason": "requested"},
        "model": {"name": "mlp", "fingerprint": "0123456789abcdef"},
        "gossip": {"algorithm": "choco", "compression": 0.9, "bits": 8, "gamma": 0.1, "configured_gamma": 0.1,
                   "topology": "ring", "window": 1},
        "last_round_s": 0.0, "divergences": 0, "gamma_halvings": 0, "lr_halvings": 0, "neighbours": {}, "refused": {},
        "dropped": {}, "applied": 0,
    }
    doc.update(fields)
    return doc


def neighbour_json(**fields: Any) -> dict[str, Any]:
    """One neighbour entry of :func:`status_json`."""
    return {"address": "", "live": True, "state": "active", "in_flight": 0, "bytes_sent": 0, "bytes_received": 0,
            "rtt_s": None, "last_seen": 0.0, "delivered": 0, "settled": {}, "last_error": "", **fields}


def status_document(**fields: Any) -> StatusDocument:
    """:func:`status_json` parsed as the readers get it."""
    return StatusDocument.from_json(status_json(**fields))

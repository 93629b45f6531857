"""Which certificate each sender's Gossip stream authenticated with: what a quarantine's log line and status name, so
an operator can revoke that certificate (``lpdl-peer ca revoke --serial``)."""

from __future__ import annotations

from collections import OrderedDict

from peer.security.identity import CertIdentity


class CertificateSerials:
    """peer id -> serial (hex) of the certificate its latest Gossip stream authenticated with, for the most recent
    ``capacity`` senders (net.max_peers: a flood of identities cannot grow it). Reads are one dict lookup, safe from
    the training thread."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._serials: OrderedDict[str, str] = OrderedDict()

    def remember(self, caller: CertIdentity | None) -> str | None:
        """``caller`` opened a Gossip stream: its serial is the one to name (the oldest sender dropped beyond
        capacity). Returns its peer id (None: no certificate, a plaintext fleet - nothing to remember)."""
        if caller is None:
            return None
        self._serials[caller.name] = f"{caller.serial:x}"
        self._serials.move_to_end(caller.name)
        while len(self._serials) > self.capacity:
            self._serials.popitem(last=False)
        return caller.name

    def get(self, peer_id: str) -> str | None:
        """The serial of ``peer_id``'s certificate; None before its first stream, or without TLS."""
        return self._serials.get(peer_id)

    def snapshot(self) -> dict[str, str]:
        """A copy of the whole table, for the server's status snapshot."""
        return dict(self._serials)

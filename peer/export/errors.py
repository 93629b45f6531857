"""The one error of ``lpdl-peer export``: every cause (a missing state directory, a checkpoint of another schema, a
remote peer refusing, a layer that cannot be traced) is one line naming it."""

from __future__ import annotations

from peer.errors import PeerError


class ExportError(PeerError, ValueError):
    """The model cannot be exported; the message is one line naming the cause (file, peer or layer)."""

    default_reason = "export"

"""The one exception type of the compress package.

Every problem found while decoding bytes that came from the wire is a `PayloadError`. It subclasses
`ValueError` so callers that already treat bad input as a value error keep working, and it is the only
exception `decode` lets escape: the transport can drop the message, log the reason, and carry on.
"""

from __future__ import annotations

from peer.errors import PeerError


class PayloadError(PeerError, ValueError):
    """A payload is malformed, truncated, tampered with, or shaped for another model.

    The message names the offending field and, where there is one, the tensor (id and parameter name).
    """

    default_reason = "bad_payload"

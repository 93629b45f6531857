"""Architecture fingerprint: peers gossip only with peers whose fingerprint matches.

The digest covers the architecture name, the options that change the parameter set or the
meaning of the parameters (num_classes, in_channels, norm, groups) and every parameter's
name and shape, never the values. The precision mode is deliberately NOT covered: fp32,
sim8 and int8 models have the same parameters (an fp32 master copy in every mode), so
peers running different precisions on different hardware can average their models.
Buffers (the quantizers' running activation ranges) are local statistics, not gossiped,
and exist only in the 8-bit modes, so they are left out too.
"""

from __future__ import annotations

import hashlib
import json

import torch

from peer.models.registry import build_model

_DIGEST_HEX_CHARS = 16


def model_fingerprint(name: str, *, num_classes: int = 10, in_channels: int = 3,
                      norm: str = "range-evonorm", groups: int = 8, **ignored: object) -> str:
    """Stable 16-hex-char sha256 digest of architecture + config + parameter names/shapes.

    Extra keyword options (e.g. ``precision``) are accepted and ignored (see module doc).
    """
    config = {"num_classes": num_classes, "in_channels": in_channels, "norm": norm,
              "groups": groups}
    with torch.device("meta"):  # shapes only: no memory, no random init
        model = build_model(name, num_classes=num_classes, in_channels=in_channels, norm=norm, groups=groups)
    params = [[n, list(p.shape)] for n, p in model.named_parameters()]
    blob = json.dumps({"arch": name, "config": config, "params": params}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:_DIGEST_HEX_CHARS]

"""Models built from the quantized layers of peer.lowp, a registry by name and a fingerprint."""

from peer.models.fingerprint import model_fingerprint
from peer.models.registry import available_models, build_model

__all__ = ["available_models", "build_model", "model_fingerprint"]

"""Names the compression room defines (torch-free, so config and CLI can import them)."""

from __future__ import annotations

#: Rounding of transmitted values: to nearest, or stochastic (unbiased).
ROUNDINGS = ("nearest", "stochastic")

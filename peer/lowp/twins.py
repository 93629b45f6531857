"""The eager-twin registry: which function runs instead of a pass body when the passes run eagerly.

Why: run eagerly, a body written as a chain of out-of-place ops allocates one full-size fp32 temporary per op, where
the compiler fuses the same chain into one kernel. A twin computes the same operations in the same order (the same
bits; tests/test_lowp_eager.py checks every twin against its body run eagerly) in place in a few buffers.
"""

from __future__ import annotations

from collections.abc import Callable

_EAGER_TWINS: dict[Callable, Callable] = {}
_RACEABLE: set[Callable] = set()  # bodies whose twin equals the COMPILED body too (StaticGraphs may race them)


def eager_twin(body: Callable, same_as_compiled: bool = False) -> Callable[[Callable], Callable]:
    """Register the decorated function as ``body``'s eager twin (see the module docstring): what ``FusedPasses.run``
    calls instead of ``body`` when the passes run eagerly. It must return ``body``'s results run eagerly, bit for bit.

    ``same_as_compiled``: the twin also equals the compiled ``body`` by construction - integer arithmetic, max and
    selections, exact fp32 operations only; no reductions or chains whose rounding a compiler may reorder or fuse (a
    compiled norm pass differs from its twin by ~5e-7 after a sum in another order) - and draws no random numbers.
    Only then may the compiled graph and the twin race for speed (StaticGraphs), so the results never depend on
    which one won."""
    def register(twin: Callable) -> Callable:
        _EAGER_TWINS[body] = twin
        if same_as_compiled:
            _RACEABLE.add(body)
        return twin
    return register


def eager_body(body: Callable) -> Callable:
    """What runs for ``body`` on the eager path: its twin if it has one, else itself."""
    return _EAGER_TWINS.get(body, body)



def raceable_twin(body: Callable) -> Callable | None:
    """``body``'s twin if it equals the compiled ``body`` by construction (it may race it, graphs.StaticGraphs)."""
    return _EAGER_TWINS.get(body) if body in _RACEABLE else None


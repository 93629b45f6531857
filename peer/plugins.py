"""Importing a user's callable named ``MODULE:CALLABLE`` or ``path/to/file.py:CALLABLE`` (models and datasets).

Kept torch-free and apart from both rooms so the model and data plug-ins import user code by one rule: a file is
imported as a module of its own (its directory first on sys.path while it loads, for its sibling imports) and
imported once per process; every failure is one line naming the reference.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from peer.errors import PeerError


class PluginError(PeerError, ValueError):
    """A plug-in reference cannot be imported or called; the message names the reference."""

    default_reason = "plugin"


def is_file_target(target: str) -> bool:
    """True where the part before the colon names a Python file rather than a module."""
    return target.endswith(".py") or "/" in target


def import_callable(target: str, attr: str, what: str) -> Callable[..., Any]:
    """The callable ``attr`` of module or file ``target``; ``what`` prefixes errors (``model nets.py:Net``)."""
    if is_file_target(target):
        module = _load_file(Path(target), what)
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as exc:
            raise PluginError(f"{what}: cannot import module {target!r} ({exc})") from None
    found = getattr(module, attr, None)
    if not callable(found):
        raise PluginError(f"{what}: {target} has no callable {attr!r}")
    return found


def accepted_kwargs(func: Callable[..., Any], offered: dict[str, Any]) -> dict[str, Any]:
    """The part of ``offered`` that ``func`` accepts by keyword: all of it with ``**kwargs``, else what its
    signature names (nothing where it has no signature)."""
    try:
        params = inspect.signature(func).parameters
    except (TypeError, ValueError):
        return {}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(offered)
    return {k: v for k, v in offered.items() if k in params}


def _load_file(path: Path, what: str) -> Any:
    if not path.is_file():
        raise PluginError(f"{what}: file {path} not found")
    resolved = path.resolve()
    name = f"lpdl_user_{resolved.stem}_{abs(hash(str(resolved))) % 10**8}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, resolved)
    if spec is None or spec.loader is None:
        raise PluginError(f"{what}: {path} is not a loadable Python file")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(resolved.parent))
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # the user's code: one line naming it, not a traceback from deep inside
        sys.modules.pop(name, None)
        raise PluginError(f"{what}: importing {path} failed: {type(exc).__name__}: {exc}") from None
    finally:
        sys.path.remove(str(resolved.parent))
    return module

"""No import circle in peer/, and no arrow from a lower floor to a higher one: every ``import`` and ``from ...
import`` of a peer module - at module level, under ``if TYPE_CHECKING:`` (a circle there is still two modules that
each need the other to be understood) or deferred inside a function - forms a graph without cycles, and no module
imports one on a floor above its own (FLOORS).

Edges go to the module named (``from peer.a import b`` also to ``peer.a.b`` when that is a module), not to the
parent packages Python initialises on the way."""

from __future__ import annotations

import ast
from pathlib import Path

import peer

ROOT = Path(peer.__file__).parent

#: The floors of peer/, lowest first, by top-level package or root module. A module may import modules of its own
#: floor or below, never above: what stands lower is understood, tested and reused without what stands on it.
#: config is the floor of the typed specs every driver shares: it stands on the domains, whose enumerations it
#: validates (the ``kinds`` modules), and below runtime. A package above config that has its own settings keeps their
#: spec and enumerations itself, standing on config's machinery: net/config.py (NetConfig), daemon/config.py
#: (NodeSpec, DaemonConfig) with daemon/kinds.py - so an enumeration a spec validates lives on that spec's floor or
#: below, and config never imports the daemon. The fleet starts daemons from config files, not from the CLI's flags.
FLOORS: tuple[tuple[str, ...], ...] = (
    # foundations
    ("peer", "errors", "compress", "security", "heap", "finite", "logs", "aio", "plugins", "energy_prices"),
    ("gossip", "lowp", "models", "data", "energy", "plots"),  # the domains: algorithms, 8-bit training, zoo, data
    ("config",),  # the typed specs every driver shares
    ("runtime",),  # assembly, the peer, the round, the checkpoint schema
    ("net",),  # the transport: gRPC shells around the pure stream classes, discovery
    ("daemon", "sim", "train"),  # the drivers
    ("export", "api"),  # tools over the drivers
    ("fleet",),  # many daemons
    ("cli", "__main__"),  # the commands
)


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """peer module -> the peer modules it imports."""
    files = {module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package, up level - 1
                    parts = package.split(".")
                    anchor = parts[: len(parts) - (node.level - 1)]
                    base = ".".join([*anchor, base] if base else anchor)
                targets.add(base)
                targets.update(f"{base}.{alias.name}" for alias in node.names)
        graph[name] = {t for t in targets if t in files and t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def test_the_checker_finds_a_circle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_graph_sees_the_runtime_modules() -> None:
    graph = import_graph()
    assert "peer.runtime.recovery" in graph["peer.runtime.peer"]
    assert "peer.runtime.peer" in graph["peer.runtime.round"]


def test_no_import_circle_in_peer() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def floor_of(module: str, floors: tuple[tuple[str, ...], ...] = FLOORS) -> int:
    """The floor of ``peer.<name>[...]`` (``peer`` itself: the package's ``__init__``); KeyError if it has none."""
    name = module.split(".")[1] if "." in module else module
    for level, names in enumerate(floors):
        if name in names:
            return level
    raise KeyError(f"{module}: no floor in FLOORS (place {name!r} on one)")


def upward_arrows(graph: dict[str, set[str]], floors: tuple[tuple[str, ...], ...] = FLOORS) -> list[str]:
    """Every import from a module to one on a higher floor, as ``a -> b (floor i -> j)``."""
    return [f"{a} -> {b} (floor {floor_of(a, floors)} -> {floor_of(b, floors)})"
            for a in sorted(graph) for b in sorted(graph[a]) if floor_of(b, floors) > floor_of(a, floors)]


def test_every_package_of_peer_has_a_floor() -> None:
    unplaced = []
    for module in import_graph():
        try:
            floor_of(module)
        except KeyError as exc:
            unplaced.append(str(exc))
    assert not unplaced, "\n".join(unplaced)


def test_the_floor_checker_finds_an_arrow_up() -> None:
    """A deliberate upward import, added to the real graph, is reported; the same graph without it is clean."""
    graph = import_graph()
    for importer, imported in (("peer.config", "peer.daemon.kinds"), ("peer.fleet.launch", "peer.cli.options"),
                               ("peer.gossip.engine", "peer.net.server"), ("peer.runtime.round", "peer.config")):
        broken = {**graph, importer: graph[importer] | {imported}}
        found = [arrow for arrow in upward_arrows(broken) if arrow.startswith(f"{importer} -> {imported} ")]
        assert bool(found) == (floor_of(imported) > floor_of(importer)), (importer, imported, found)
    assert upward_arrows({"peer.a.x": {"peer.b.y"}, "peer.b.y": set()}, (("b",), ("a",))) == []
    assert upward_arrows({"peer.a.x": {"peer.b.y"}, "peer.b.y": set()}, (("a",), ("b",))) == \
        ["peer.a.x -> peer.b.y (floor 0 -> 1)"]


def test_no_arrow_from_a_lower_floor_to_a_higher_one() -> None:
    arrows = upward_arrows(import_graph())
    assert not arrows, "imports up a floor:\n" + "\n".join(arrows)


def test_config_stands_below_the_daemon_and_the_fleet_below_the_cli() -> None:
    """The two arrows this order forbids by name (issue 22): config -> daemon, fleet -> cli."""
    graph = import_graph()
    assert not {t for t in graph["peer.config"] if t.startswith("peer.daemon")}
    assert not {t for m, ts in graph.items() if m.startswith("peer.fleet") for t in ts if t.startswith("peer.cli")}
    assert floor_of("peer.config") < floor_of("peer.daemon.kinds") and floor_of("peer.fleet") < floor_of("peer.cli")

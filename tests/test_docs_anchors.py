"""Every section reference in the repository points at a heading that exists.

The design and the method live in docs/design.md and docs/method.md; code refers to their sections as
``docs/<file>.md#<anchor>`` with GitHub's heading anchors. This test scans the code, tests, scripts, deployment
files and the Markdown documents for such references and fails on one whose file or heading is missing, and on any
reference to the former section-numbered documents outside the repository (upper-case names, numbered sections),
which a reader who clones the repository cannot open.
"""

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: What is scanned: directories (recursively) and single files, relative to the repository root.
SCANNED = ("peer", "bench", "tests", "scripts", "deploy", "systemd", "docs", "README.md")
SKIPPED_DIRS = {"__pycache__", ".pytest_cache"}
#: A reference to a Markdown file's heading: ``docs/design.md#trust`` from anywhere, or, inside docs/, a path
#: relative to the referring file followed by ``#`` and the anchor.
REFERENCE = re.compile(r"((?:\.\./)*(?:[\w.-]+/)*[\w-]+\.md)#([A-Za-z0-9_-]+)")
#: The former documents, which are not in the repository.
OLD_STYLE = re.compile(r"\b(?:DESIGN|METHOD)\.md\b|shared/(?:DESIGN|METHOD|TESTBED)")
FENCE = re.compile(r"^\s*(```|~~~)")


def github_anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation other than ``-`` and ``_`` dropped, spaces -> ``-``."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(markdown: Path) -> set[str]:
    """The anchors of every heading of ``markdown`` outside code fences, with GitHub's ``-1``, ``-2`` for repeats."""
    found: set[str] = set()
    counts: dict[str, int] = {}
    in_fence = False
    for line in markdown.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        match = None if in_fence else re.match(r"^#{1,6}\s+(.+?)\s*#*\s*$", line)
        if match:
            base = github_anchor(match.group(1))
            n = counts.get(base, 0)
            counts[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def scanned_files() -> Iterator[Path]:
    for name in SCANNED:
        path = ROOT / name
        if path.is_file():
            yield path
        elif path.is_dir():
            for f in sorted(path.rglob("*")):
                if f.is_file() and not SKIPPED_DIRS.intersection(f.relative_to(ROOT).parts):
                    yield f


def text_of(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None  # binary files (data, images) hold no references


def target(source: Path, reference: str) -> Path:
    """The file a reference names: ``docs/...`` from the repository root, anything else relative to ``source``."""
    if reference.startswith("docs/"):
        return ROOT / reference
    return (source.parent / reference).resolve()


def references() -> list[tuple[Path, int, str, str]]:
    found = []
    for path in scanned_files():
        text = text_of(path)
        if text is None:
            continue
        for lineno, line in enumerate(text.splitlines(), 1):
            for m in REFERENCE.finditer(line):
                found.append((path, lineno, m.group(1), m.group(2)))
    return found


def test_the_design_documents_exist() -> None:
    for name in ("design.md", "method.md"):
        assert anchors(ROOT / "docs" / name), f"docs/{name} has no headings"


def test_every_section_reference_names_an_existing_heading() -> None:
    cache: dict[Path, set[str]] = {}
    broken = []
    refs = references()
    for path, lineno, reference, anchor in refs:
        doc = target(path, reference)
        if not doc.is_file():
            broken.append(f"{path.relative_to(ROOT)}:{lineno}: {reference}#{anchor}: no such file")
            continue
        if doc not in cache:
            cache[doc] = anchors(doc)
        if anchor not in cache[doc]:
            broken.append(f"{path.relative_to(ROOT)}:{lineno}: {reference}#{anchor}: no such heading")
    assert any(ref.startswith("docs/design.md") for _, _, ref, _ in refs), "the scan found no design references"
    assert not broken, "\n".join(broken)


def test_no_reference_to_documents_outside_the_repository() -> None:
    old = []
    for path in scanned_files():
        text = text_of(path)
        if text is None:
            continue
        for lineno, line in enumerate(text.splitlines(), 1):
            if OLD_STYLE.search(line):
                old.append(f"{path.relative_to(ROOT)}:{lineno}: {line.strip()[:100]}")
    assert not old, "references to documents that are not in the repository:\n" + "\n".join(old)


@pytest.mark.parametrize("heading, anchor", [
    ("Exactly-once mass transfer", "exactly-once-mass-transfer"),
    ("8-bit local training", "8-bit-local-training"),
    ("The `window` (W)", "the-window-w"),
])
def test_github_anchor(heading: str, anchor: str) -> None:
    assert github_anchor(heading) == anchor


def _rooms() -> set[str]:
    """Every package (``cli/``) and root module (``api.py``) of peer/."""
    peer = ROOT / "peer"
    return {f"{p.name}/" for p in peer.iterdir() if (p / "__init__.py").is_file()} | \
        {p.name for p in peer.glob("*.py")}


def test_the_readme_layout_and_the_package_map_name_every_room() -> None:
    """The README's layout and peer/__init__.py's package map name every package and root module of peer/ (a room
    added, renamed or removed is reflected in both)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    layout = readme.split("## Layout", 1)[1].split("\n## ", 1)[0]
    package_map = (ROOT / "peer" / "__init__.py").read_text(encoding="utf-8").split('"""')[1]
    rooms = _rooms()
    assert {"cli/", "daemon/", "api.py", "__main__.py"} <= rooms
    for name, text in (("README layout", layout), ("peer/__init__.py", package_map)):
        named = {room for room in rooms if re.search(rf"(?<![\w/.]){re.escape(room)}", text)}
        missing = rooms - named - ({"__init__.py"} if name == "peer/__init__.py" else set())
        assert not missing, f"{name} leaves out {sorted(missing)}"

"""mypy over peer/ is clean: a baseline pass over every module, the strict flag set on the packages the daemon and
the simulator share (peer.gossip, peer.runtime, peer.net). Configuration: pyproject.toml [tool.mypy].

mypy runs as a subprocess from the repository root, so it reads the same configuration a developer's `mypy` does;
its cache (.mypy_cache) makes a warm run a few seconds."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
STRICT_PACKAGES = ("peer.gossip.*", "peer.runtime.*", "peer.net.*")
#: Global-only options: they hold for the whole run and cannot appear in a per-module section.
GLOBAL_ONLY = {"warn_unused_configs"}


def run_mypy(*args: str) -> subprocess.CompletedProcess[str]:
    try:
        import mypy  # noqa: F401 - only to fail with the cause below
    except ImportError:
        pytest.fail("mypy is not installed: it is part of the dev and test extras (pip install -e '.[test]')")
    return subprocess.run([sys.executable, "-m", "mypy", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=600)


def strict_flags() -> set[str]:
    """The options mypy's own --strict turns on (from its --help, so a newer mypy's additions are checked too)."""
    help_text = run_mypy("--help").stdout
    # the list runs over indented continuation lines until the next option (indented by two spaces) or a blank line
    match = re.search(r"--strict\s+Strict mode; enables the following flags:(.*?)(?:\n {1,4}-|\n\s*\n)", help_text,
                      re.S)
    assert match, "could not read the flag list of --strict from mypy --help"
    flags = re.sub(r"-\s*\n\s*", "-", match.group(1))  # rejoin flags wrapped at a hyphen
    names = {flag.replace("-", "_") for flag in re.findall(r"--([a-z-]+)", flags)}
    assert "disallow_untyped_defs" in names, f"unexpected --strict flag list in mypy --help: {match.group(1)!r}"
    return names


def test_mypy_clean_over_peer() -> None:
    result = run_mypy()  # files, strict sections and exclusions all from pyproject.toml
    errors = [line for line in result.stdout.splitlines() if ": error:" in line]
    assert result.returncode == 0 and not errors, (
        f"mypy found {len(errors)} error(s):\n" + "\n".join(errors or [result.stdout, result.stderr]))


def test_strict_flag_set_covers_the_shared_packages() -> None:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["mypy"]
    sections = [o for o in config.get("overrides", []) if set(STRICT_PACKAGES) <= set(o["module"])]
    assert sections, f"no [[tool.mypy.overrides]] section names {STRICT_PACKAGES}"
    enabled = {k for k, v in config.items() if v is True} | {k for k, v in sections[0].items() if v is True}
    missing = strict_flags() - enabled - GLOBAL_ONLY
    assert not missing, f"the strict packages lack these --strict options: {sorted(missing)}"
    assert config.get("warn_unused_configs") is True

"""The daemon's choice of malloc (peer/daemon/allocator.py): what it plans, that the re-exec really swaps the
allocator in the same process id, and that the daemon reports the one it runs on."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from click.testing import CliRunner

from peer.cli.main import cli
from peer.daemon.allocator import (
    ALLOCATOR_LIBRARIES,
    PRELOAD_BEFORE_ENV,
    REEXEC_ENV,
    AllocatorError,
    find_library,
    in_use,
    plan,
)
from peer.daemon.kinds import ALLOCATORS

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LD_PRELOAD and /proc are Linux's")


def finder(*installed: str):
    return lambda soname: f"/usr/lib/{soname}" if soname in installed else None


TC, JE = ALLOCATOR_LIBRARIES["tcmalloc"], ALLOCATOR_LIBRARIES["jemalloc"]


def test_the_allowed_allocators_are_auto_glibc_and_every_library_known() -> None:
    """node.allocator is validated against daemon/kinds.py; allocator.py knows the libraries: they must agree."""
    assert ALLOCATORS == ("auto", "glibc", *ALLOCATOR_LIBRARIES)


@linux_only
def test_auto_prefers_tcmalloc_then_jemalloc_and_stays_without_either() -> None:
    both = plan("auto", {"PATH": "/bin"}, 42, finder(TC, JE))
    assert both is not None and both[0] == "tcmalloc"
    assert both[1]["LD_PRELOAD"] == f"/usr/lib/{TC}" and both[1][REEXEC_ENV] == "42"
    assert both[1]["PATH"] == "/bin"  # the rest of the environment is kept
    only_je = plan("auto", {}, 42, finder(JE))
    assert only_je is not None and only_je[0] == "jemalloc"
    assert plan("auto", {}, 42, finder()) is None


@linux_only
def test_no_reexec_for_glibc_or_for_the_reexecuted_process_itself() -> None:
    assert plan("glibc", {}, 42, finder(TC)) is None
    assert plan("auto", {REEXEC_ENV: "42"}, 42, finder(TC)) is None  # never loops
    # a marker inherited from another process (a daemon started by a daemon) is not this process's: it re-executes
    assert plan("jemalloc", {REEXEC_ENV: "41"}, 42, finder(JE)) is not None
    kept = plan("jemalloc", {"LD_PRELOAD": "libfoo.so"}, 42, finder(JE))
    assert kept is not None and kept[1]["LD_PRELOAD"] == f"/usr/lib/{JE}:libfoo.so"
    assert kept[1][PRELOAD_BEFORE_ENV] == "libfoo.so"


def test_a_named_allocator_that_is_not_installed_is_an_error_naming_the_package() -> None:
    if not sys.platform.startswith("linux"):
        pytest.skip("allocators are swapped on Linux only")
    with pytest.raises(AllocatorError, match="node.allocator: tcmalloc .* apt install libtcmalloc-minimal4"):
        plan("tcmalloc", {}, 42, finder(JE))


def test_find_library_looks_in_the_given_directories(tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / TC).write_bytes(b"")
    assert find_library(TC, [tmp_path / "a", tmp_path / "b"]) == str(tmp_path / "b" / TC)
    assert find_library(JE, [tmp_path / "b"]) is None


def test_in_use_reads_what_is_mapped(tmp_path: Path) -> None:
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n")
    assert in_use(maps) == "glibc"
    maps.write_text(maps.read_text() + "7f02-7f03 r-xp 0 08:01 2 /usr/lib/libtcmalloc_minimal.so.4.5.10\n")
    assert in_use(maps) == "tcmalloc"
    assert in_use(tmp_path / "absent") == "system"


def installed() -> list[str]:
    return [name for name, soname in ALLOCATOR_LIBRARIES.items() if find_library(soname)]


@linux_only
@pytest.mark.parametrize("choice", ["auto", "glibc"])
def test_reexec_swaps_the_allocator_in_the_same_process(choice: str) -> None:
    """A fresh interpreter asks for ``choice``: it re-executes itself (same PID) onto the first installed
    allocator, or stays on glibc; the re-executed process restores LD_PRELOAD for its children; trim_heap then
    releases memory through whichever allocator runs."""
    if choice == "auto" and not installed():
        pytest.skip("neither tcmalloc nor jemalloc is installed (scripts/setup.sh installs tcmalloc when root)")
    code = ("import os, sys; print('pid', os.getpid(), flush=True); "
            f"from peer.daemon.allocator import reexec_with, in_use; reexec_with({choice!r}); "
            "from peer.heap import trim_heap; "
            "print('pid', os.getpid(), in_use(), trim_heap(), os.environ.get('LD_PRELOAD', '-'))")
    env = {k: v for k, v in os.environ.items() if k not in (REEXEC_ENV, "LD_PRELOAD")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout
    lines = out.splitlines()
    expected = installed()[0] if choice == "auto" else "glibc"
    # 'pid N' once per start of the program: twice when it re-executed itself, and always the same N
    assert len(lines) == (3 if choice == "auto" else 2), out
    assert len({line.split()[1] for line in lines}) == 1, out
    assert lines[-1].split()[2:] == [expected, "True", "-"], out


def test_start_run_in_process_never_reexecutes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the process's own entry point may re-execute: `start` called in-process (a test runner, a program
    embedding the CLI) must not replace the caller."""
    monkeypatch.setattr(os, "execve", lambda *a: pytest.fail(f"start re-executed the calling process: {a[1]}"))
    result = CliRunner().invoke(cli, ["start", "--insecure", "--state-dir", str(tmp_path), "--dataset", "cifar10",
                                      "--data-root", str(tmp_path / "absent"), "--allocator", "auto"])
    assert result.exit_code != 0 and "CIFAR-10" in result.output, result.output


def test_start_as_the_process_entry_ends_with_a_hard_exit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon's process, its shutdown done, exits through hard_exit with the node's exit code (skipping the
    C exit handlers' memory spike, peer/daemon/exit.py); called in-process it raises SystemExit as before."""
    import peer.cli.main as entry
    import peer.cli.start as start_module
    import peer.daemon.exit
    import peer.daemon.node

    class StubNode:
        def __init__(self, *args: object) -> None:
            pass

        async def run(self) -> int:
            return 3

    exits: list[int] = []

    def fake_hard_exit(code: int) -> None:
        exits.append(code)
        raise SystemExit(code)

    monkeypatch.setattr(peer.daemon.node, "Node", StubNode)
    monkeypatch.setattr(peer.daemon.exit, "hard_exit", fake_hard_exit)
    monkeypatch.setattr(start_module, "reexec_with", lambda choice: None)
    args = ["start", "--insecure", "--state-dir", str(tmp_path)]
    monkeypatch.setattr(entry, "PROCESS_ENTRY", True)
    assert CliRunner().invoke(cli, args).exit_code == 3 and exits == [3]
    monkeypatch.setattr(entry, "PROCESS_ENTRY", False)
    assert CliRunner().invoke(cli, args).exit_code == 3 and exits == [3]

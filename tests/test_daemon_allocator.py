"""The daemon's choice of malloc (peer/daemon/allocator.py): what it plans, that the re-exec really swaps the
allocator in the same process id, and that the daemon reports the one it runs on."""

from __future__ import annotations

import ctypes.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from peer.daemon.allocator import ALLOCATOR_LIBRARIES, GUARD_ENV, AllocatorError, in_use, plan

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LD_PRELOAD and /proc are Linux's")


def finder(*installed: str):
    return lambda library: f"lib{library}.so.9" if library in installed else None


@linux_only
def test_auto_prefers_tcmalloc_then_jemalloc_and_stays_without_either() -> None:
    both = plan("auto", {"PATH": "/bin"}, finder("tcmalloc_minimal", "jemalloc"))
    assert both is not None and both[0] == "tcmalloc"
    assert both[1]["LD_PRELOAD"] == "libtcmalloc_minimal.so.9" and both[1][GUARD_ENV] == "tcmalloc"
    assert both[1]["PATH"] == "/bin"  # the rest of the environment is kept
    only_je = plan("auto", {}, finder("jemalloc"))
    assert only_je is not None and only_je[0] == "jemalloc"
    assert plan("auto", {}, finder()) is None


@linux_only
def test_no_reexec_for_glibc_or_when_already_reexecuted_and_preloads_are_kept() -> None:
    assert plan("glibc", {}, finder("tcmalloc_minimal")) is None
    assert plan("auto", {GUARD_ENV: "tcmalloc"}, finder("tcmalloc_minimal")) is None  # never loops
    kept = plan("jemalloc", {"LD_PRELOAD": "libfoo.so"}, finder("jemalloc"))
    assert kept is not None and kept[1]["LD_PRELOAD"] == "libjemalloc.so.9:libfoo.so"


def test_a_named_allocator_that_is_not_installed_is_an_error_naming_the_package() -> None:
    if not sys.platform.startswith("linux"):
        pytest.skip("allocators are swapped on Linux only")
    with pytest.raises(AllocatorError, match="node.allocator: tcmalloc .* apt install libtcmalloc-minimal4"):
        plan("tcmalloc", {}, finder("jemalloc"))


def test_in_use_reads_what_is_mapped(tmp_path: Path) -> None:
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n")
    assert in_use(maps) == "glibc"
    maps.write_text(maps.read_text() + "7f02-7f03 r-xp 0 08:01 2 /usr/lib/libtcmalloc_minimal.so.4.5.10\n")
    assert in_use(maps) == "tcmalloc"
    assert in_use(tmp_path / "absent") == "system"


def installed() -> list[str]:
    return [name for name, library in ALLOCATOR_LIBRARIES.items() if ctypes.util.find_library(library)]


@linux_only
@pytest.mark.parametrize("choice", ["auto", "glibc"])
def test_reexec_swaps_the_allocator_in_the_same_process(choice: str) -> None:
    """A fresh interpreter asks for ``choice``: it re-executes itself (same PID) onto the first installed
    allocator, or stays on glibc; trim_heap then releases memory through whichever one runs."""
    if choice == "auto" and not installed():
        pytest.skip("neither tcmalloc nor jemalloc is installed (scripts/setup.sh installs tcmalloc as root)")
    code = ("import os, sys; print('pid', os.getpid(), flush=True); "
            f"from peer.daemon.allocator import reexec_with, in_use; reexec_with({choice!r}); "
            "from peer.daemon.memory import trim_heap; print('pid', os.getpid(), in_use(), trim_heap())")
    env = {k: v for k, v in os.environ.items() if k not in (GUARD_ENV, "LD_PRELOAD")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout
    lines = out.splitlines()
    expected = installed()[0] if choice == "auto" else "glibc"
    # 'pid N' once per start of the program: twice when it re-executed itself, and always the same N
    assert len(lines) == (3 if choice == "auto" else 2), out
    assert len({line.split()[1] for line in lines}) == 1, out
    assert lines[-1].split()[2:] == [expected, "True"], out

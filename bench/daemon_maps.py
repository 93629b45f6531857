"""Where a daemon's peak resident set lies, by kind of mapping: run it beside bench/fleet.py to see what an int8
daemon holds that an fp32 one does not (and the reverse).

Polls /proc/<pid>/smaps of every running ``lpdl-peer start`` process every ``--interval`` seconds and keeps, per
process, the sample with the largest total Rss, split into

    heap            the allocator's heap ([heap])
    anon            anonymous mappings (large allocations, thread stacks, what a fork inherited)
    libtorch_cpu    torch's CPU library (only the pages this process touched: a forked daemon shares the rest)
    pass libraries  the int8 passes compiled ahead of time (peer/lowp/aot_graphs.py), one library per graph
    other libraries every other shared object (torch's other libraries, gRPC, Python's extensions)
    other           stacks, vdso, locale and data files

At the end (``--seconds``, or Ctrl-C) it prints, per case (the run directory's name, such as ``sgp-int8bg``), the
mean over its daemons of each kind (MiB), and the difference of each int8 case from the fp32 case of the same
algorithm. The sample's total is the sum of the mappings' Rss at one moment: within a poll of VmHWM, not equal to
it (a peak between two polls is missed).

Usage: python bench/daemon_maps.py [--seconds 900] [--interval 0.3] [--out maps.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import statistics
import time
from pathlib import Path

KINDS = ("heap", "anon", "libtorch_cpu", "pass libraries", "other libraries", "other")
#: The case in a daemon's command line: bench/fleet.py runs each in OUT/<checkout>/<case>/peer-<i>.toml.
CASE = re.compile(r"/([^/]+)/peer-\d+\.toml")


def kind_of(path: str) -> str:
    """The kind of one mapping, by the file (or pseudo-file) it maps."""
    if "aot-graphs" in path:
        return "pass libraries"
    if path == "[heap]":
        return "heap"
    if path == "":
        return "anon"
    if "libtorch_cpu" in path:
        return "libtorch_cpu"
    if path.endswith(".so") or ".so." in path:
        return "other libraries"
    return "other"


def rss_by_kind(pid: int) -> dict[str, int]:
    """KiB of Rss per kind of mapping of one process now (raises OSError once it has gone)."""
    totals: collections.Counter[str] = collections.Counter()
    kind = "other"
    with open(f"/proc/{pid}/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if fields[0] == "Rss:":
                totals[kind] += int(fields[1])
            elif not fields[0].endswith(":"):  # a mapping's header: range perms offset dev inode [path]
                kind = kind_of(fields[5] if len(fields) > 5 else "")
    return dict(totals)


def daemons() -> dict[int, str]:
    """pid -> case of every running daemon started by a fleet run."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            command = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        match = CASE.search(command)
        if "lpdl-peer start" in command and match:
            found[int(entry)] = match.group(1)
    return found


def poll(seconds: float, interval: float) -> dict[int, tuple[str, dict[str, int]]]:
    """pid -> (case, its largest sample) over ``seconds``."""
    peaks: dict[int, tuple[str, dict[str, int]]] = {}
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            for pid, case in daemons().items():
                try:
                    sample = rss_by_kind(pid)
                except OSError:
                    continue
                if pid not in peaks or sum(sample.values()) > sum(peaks[pid][1].values()):
                    peaks[pid] = (case, sample)
            time.sleep(interval)
    except KeyboardInterrupt:
        pass
    return peaks


def report(peaks: dict[int, tuple[str, dict[str, int]]]) -> str:
    """Mean MiB per kind for each case, and each int8 case minus the fp32 case of its algorithm."""
    by_case: dict[str, list[dict[str, int]]] = collections.defaultdict(list)
    for case, sample in peaks.values():
        by_case[case].append(sample)
    means = {case: {k: statistics.mean(s.get(k, 0) for s in samples) / 1024 for k in KINDS}
             for case, samples in sorted(by_case.items())}
    lines = ["| case | daemons | " + " | ".join(KINDS) + " | total |", "|---|---:|" + "---:|" * (len(KINDS) + 1)]
    for case, mean in means.items():
        lines.append(f"| {case} | {len(by_case[case])} | " + " | ".join(f"{mean[k]:.1f}" for k in KINDS)
                     + f" | {sum(mean.values()):.1f} |")
    for case, mean in means.items():
        algorithm, _, precision = case.rpartition("-")
        base = means.get(f"{algorithm}-fp32")
        if precision.startswith("int8") and base:
            lines.append(f"| {case} - {algorithm}-fp32 | | " + " | ".join(f"{mean[k] - base[k]:+.1f}" for k in KINDS)
                         + f" | {sum(mean.values()) - sum(base.values()):+.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=900.0, help="how long to poll")
    parser.add_argument("--interval", type=float, default=0.3, help="seconds between polls")
    parser.add_argument("--out", type=Path, default=None, help="write every daemon's largest sample here (JSON)")
    args = parser.parse_args()
    peaks = poll(args.seconds, args.interval)
    if args.out:
        args.out.write_text(json.dumps({str(pid): {"case": c, "kib": s} for pid, (c, s) in peaks.items()}, indent=1))
    print(report(peaks))


if __name__ == "__main__":
    main()

"""Issue 12 ablation: learning curves of 8-peer runs under skew, one `lpdl-peer simulate` subprocess per run.

Each run is ``lpdl-peer simulate --peers 8 --precision int8 --threads 1 --no-plot`` plus its own flags, so every
curve goes through the runtime's one round function (peer/runtime/round.py) and is measured after every epoch
(averaged-model accuracy, mean per-peer accuracy, consensus distance). Runs are niced, at most ``--jobs`` at once,
and skipped when their results.json (or a failure marker) exists, so an interrupted invocation resumes.

    python bench/ablation_noniid.py run [--only PREFIX] [--jobs 2]    # run what is missing
    python bench/ablation_noniid.py table                             # print the curves at epochs 5/10/20
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

C99 = ["--algorithm", "choco", "--compression", "0.99"]
C0 = ["--algorithm", "choco", "--compression", "0"]
DS99 = ["--algorithm", "deepsqueeze", "--compression", "0.99"]


def runs() -> dict[str, tuple[list[str], dict[str, str], str]]:
    """name -> (simulate flags, extra environment, what it tests). Names: s<skew>-<what>-e<epochs>[-seed]. Every
    99% run names its gamma (the default changed from 0.02 to 0.05 during this ablation)."""
    out: dict[str, tuple[list[str], dict[str, str], str]] = {}

    def add(name: str, skew: float, flags: list[str], what: str, epochs: int = 10,
            env: dict[str, str] | None = None, seed: int = 0) -> None:
        key = f"s{skew:g}-{name}-e{epochs}" + (f"-seed{seed}" if seed else "")
        out[key] = (["--skew", f"{skew:g}", "--epochs", str(epochs), "--seed", str(seed), *flags], env or {}, what)

    def consensus(case: str, what: str) -> None:
        out[f"cons-{case.replace(':', '-g')}"] = ([case], {}, what)

    def g(value: float) -> list[str]:
        return [*C99, "--gamma", f"{value:g}"]

    for skew in (0.9, 0.4, 0.8):
        add("c0", skew, C0, "reference: 0% compression (gamma 1)")
    for skew in (0.9, 0.4, 0.8):
        add("c99-g0.02", skew, g(0.02), "gamma 0.02 (the former default)")
    for value in (0.01, 0.05, 0.1):
        add(f"c99-g{value:g}", 0.9, g(value), f"gamma {value:g}")
    add("c99-g0.05", 0.8, g(0.05), "gamma 0.05 (the new default)")
    for case in ("ring:0.05", "ring:0.1", "ring-rotating:0.05", "ring-rotating:0.1"):
        consensus(case, "pure consensus stability (no training, 1,500 rounds)")
    for topo, flags in (("ringrot", ["--topology", "ring", "--rotating"]),
                        ("exprot", ["--topology", "exponential", "--rotating"]),
                        ("torus", ["--topology", "torus"]), ("exp", ["--topology", "exponential"])):
        add(f"c99-g0.02-{topo}", 0.9, [*g(0.02), *flags], f"graph: {' '.join(flags[1:])} (gamma 0.02)")
    add("c99-g0.05-lr0.1", 0.9, [*g(0.05), "--lr", "0.1"], "lr 0.1 (the paper's) instead of 0.05")
    add("c99-g0.05-wu2", 0.9, g(0.05), "2 warm-up epochs instead of 1", env={"LPDL_OPTIM_WARMUP_EPOCHS": "2"})
    add("c99-g0.05-qgm", 0.9, [*g(0.05), "--qgm"], "quasi-global momentum")
    add("c99-g0.05", 0.9, g(0.05), "run length: 20 epochs", epochs=20)
    add("c0", 0.9, C0, "run length: 20 epochs, 0% compression", epochs=20)
    for case in ("torus:0.05", "exponential:0.05", "exponential-rotating:0.05"):
        consensus(case, "pure consensus stability (no training, 1,500 rounds)")
    return out


def run_one(name: str, flags: list[str], env_extra: dict[str, str], out_root: Path, code: Path) -> None:
    out = out_root / name
    if (out / "results.json").exists() or (out / "failed").exists() or (out / "log.txt").exists():
        return  # done, failed, or started by another invocation (delete log.txt to run it again)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(code), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TQDM_DISABLE="1",
               **env_extra)
    if name.startswith("cons-"):  # pure consensus, no training
        cmd = ["nice", "-n", "19", sys.executable, str(code / "bench" / "consensus_gamma.py"), "--rounds", "1500",
               "--out", str(out / "consensus.jsonl"), *flags]
    else:
        cmd = ["nice", "-n", "19", sys.executable, "-m", "peer.cli.main", "simulate", "--peers", "8",
               "--precision", "int8", "--threads", "1", "--no-plot", "--out", str(out), *flags]
    started = time.perf_counter()
    with (out / "log.txt").open("w") as log:
        log.write(" ".join(cmd) + f"  env {env_extra}\n")
        log.flush()
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=code, env=env, check=False).returncode
    if rc == 0 and (out / "consensus.jsonl").exists():
        (out / "results.json").write_text((out / "consensus.jsonl").read_text().splitlines()[-1])
    if rc != 0 and not (out / "results.json").exists():
        (out / "failed").write_text(str(rc))
    print(f"{name:34s} rc={rc} {time.perf_counter() - started:7.0f} s", flush=True)


BEGIN, END = "<!-- BEGIN ABLATION TABLE -->", "<!-- END ABLATION TABLE -->"


def table(out_root: Path, at: tuple[int, ...] = (5, 10, 20)) -> str:
    """Curves at the given epochs: averaged-model acc % / mean per-peer acc % / consensus distance."""
    lines = [("Regenerate: `python bench/ablation_noniid.py run --jobs 2` (resumable), then `... table --doc "
             "docs/RESULTS.md`. Cells: averaged-model accuracy % / mean per-peer accuracy % / consensus distance "
             "after that epoch; int8, 8-peer directed ring unless the row says otherwise, seed 0."), "",
             "| skew | run | " + " | ".join(f"epoch {e}" for e in at) + " | MB/peer | recoveries |",
             "|---:|---|" + "---|" * len(at) + "---:|---:|"]
    consensus = ["", ("Pure consensus (`bench/consensus_gamma.py`: 8 peers, Choco at 99%, no training, every peer "
                 "from its own random model): consensus distance relative to the start after N rounds."), "",
                 "| graph (spectral gap) | gamma | 50 | 200 | 400 | 800 | 1500 |", "|---|---:|---:|---:|---:|---:|---:|"]
    for name, (flags, _, what) in runs().items():
        path = out_root / name / "results.json"
        if not path.exists() and (out_root / name / "consensus.jsonl").exists():
            path = out_root / name / "consensus.jsonl"  # a consensus run whose runner was stopped after it
        if not path.exists():
            continue
        text = path.read_text()
        res = json.loads(text.splitlines()[-1] if path.suffix == ".jsonl" else text)
        if "relative_distance" in res:
            d = res["relative_distance"]
            cells = [f"{d[str(r)]:.3g}" if str(r) in d else "(>10x: stopped)" for r in (50, 200, 400, 800, 1500)]
            consensus.append(f"| {res['topology']} ({res['gap']:.3f}) | {res['gamma']:g} | " + " | ".join(cells)
                             + " |")
            continue
        rows = {round(r["epoch"]): r for r in res["rows"]}
        cells = [f"{rows[e]['avg_model_acc'] * 100:.1f} / {rows[e]['mean_peer_acc'] * 100:.1f} / "
                 f"{rows[e]['consensus_distance']:.2f}" if e in rows else "" for e in at]
        skew = flags[flags.index("--skew") + 1]
        lines.append(f"| {skew} | {what} | " + " | ".join(cells) + f" | {res['rows'][-1]['bytes_per_peer'] / 1e6:.2f}"
                     f" | {len(res.get('recoveries', []))} |")
    return "\n".join(lines + (consensus if len(consensus) > 5 else []))


def write_doc(path: Path, generated: str) -> None:
    text = path.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{path}: no {BEGIN} ... {END} block to replace")
    head, rest = text.split(BEGIN, 1)
    path.write_text(head + f"{BEGIN}\n{generated}\n{END}" + rest.split(END, 1)[1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("phase", choices=["run", "table"])
    p.add_argument("--only", default="", help="Run only names starting with one of these comma-separated prefixes.")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "ablation")
    p.add_argument("--code", type=Path, default=ROOT, help="Checkout the runs import (PYTHONPATH).")
    p.add_argument("--doc", type=Path, default=None, help="Rewrite the ablation block of this file (table phase).")
    args = p.parse_args()
    if args.phase == "run":
        prefixes = tuple(args.only.split(","))
        todo = [(n, f, e) for n, (f, e, _) in runs().items() if n.startswith(prefixes)]
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            list(pool.map(lambda r: run_one(*r, args.out, args.code.resolve()), todo))
    text = table(args.out)
    if args.doc is not None:
        write_doc(args.doc, text)
    print(text)


if __name__ == "__main__":
    main()

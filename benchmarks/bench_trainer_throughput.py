"""How fast does the trainer train the tiny SD3.5-Medium-like model on CPU, with 1 and 2 processes?

    python -m benchmarks.bench_trainer_throughput [--steps 12] [--batch 8] [--json]

Runs `trainer/run.py` (one process) and `torchrun --nproc_per_node=2 trainer/run.py` (DDP and FSDP2,
gloo) on the same cached data, for T5 attention (every module converted) and for the unconverted
softmax (SDPA) model, both training all weights. Every process gets one thread (OMP_NUM_THREADS=1),
so two processes use twice the cores of one. Before any speed is reported, the two-process losses
are checked against the one-process losses of the same model (same global batches); a mismatch
prints FAIL. Throughput is the global batch over the median step time after `--warmup` steps.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks.timing import REPO_ROOT, fmt_x, header_line, markdown_table, publish, speedup
from testing.trainer_assets import write_base, write_cache
from trainer.metrics import read_metrics

TITLE = "Trainer throughput"
RUN = str(REPO_ROOT / "trainer" / "run.py")
LOSS_RTOL = 1e-5
"""fp32 on CPU: one and two processes differ only in the order of gradient sums."""


def _train(root: Path, name: str, *, procs: int, mode: str, layers: str, args: argparse.Namespace) -> list[dict]:
    out = root / name
    flags = [
        "--model.base", str(root / "base"), "--model.layers", layers, "--model.trainable", "all",
        "--data.source", "cache", "--data.path", str(root / "cache"), "--parallel.mode", mode,
        "--training.batch_size", str(args.batch), "--training.steps", str(args.steps), "--checkpoint.every", "0",
        "--output.dir", str(out), "--output.progress", "false",
    ]  # fmt: skip
    launcher = [sys.executable, RUN] if procs == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}", RUN
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([*launcher, *flags], cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{done.stderr[-3000:]}")
    return read_metrics(out / "metrics.jsonl")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8, help="global batch")
    parser.add_argument("--json", action="store_true", help="write benchmarks/results/trainer_throughput.json")
    args = parser.parse_args()

    print(header_line())
    results: dict[tuple[str, int, str], list[dict]] = {}
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        write_base(root / "base")
        write_cache(root / "cache", buckets=((16, 24),), per_bucket=4 * args.batch)
        for attention, layers in (("sdpa", "none"), ("t5", "all")):
            for procs, mode in ((1, "ddp"), (2, "ddp"), (2, "fsdp2")):
                name = f"{attention}-{procs}-{mode}"
                results[(attention, procs, mode)] = _train(root, name, procs=procs, mode=mode, layers=layers, args=args)
    rows = []
    for (attention, procs, mode), metrics in results.items():
        one = [m["loss/total"] for m in results[(attention, 1, "ddp")]]
        mine = [m["loss/total"] for m in metrics]
        ok = torch.allclose(torch.tensor(mine), torch.tensor(one), rtol=LOSS_RTOL, atol=0)
        ms = 1e3 * statistics.median(m["time/step(s)"] for m in metrics[args.warmup :])
        row = dict(attention=attention, procs=procs, mode=mode, ms_per_step=round(ms, 2), check="ok" if ok else "FAIL")
        rows.append({**row, "img_per_s": round(args.batch / ms * 1e3, 2)} if ok else row)
    publish("trainer_throughput", rows, vars(args), table=table, write=args.json)


def table(result: dict[str, Any]) -> list[str]:
    """The markdown table: ms per step, the speedup vs softmax and vs one process."""
    meta = result["meta"]
    intro = (
        f"Training steps of the trainer on its tiny test model (global batch {meta['batch']}, median after "
        f"{meta['warmup']} warm-up steps, one thread per process); speedup is against softmax (SDPA) at the same "
        "processes and mode, and vs 1 process is the 1-process time / this time."
    )
    ms = {(row["attention"], row["procs"], row["mode"]): row["ms_per_step"] for row in result["rows"]}
    rows = []
    for row in result["rows"]:
        key = (row["attention"], row["procs"], row["mode"])
        mode = "-" if row["procs"] == 1 else row["mode"].upper()
        if row["check"] != "ok":
            rows.append([row["attention"].upper(), row["procs"], mode, "FAIL: losses differ from one process", "", ""])
            continue
        vs_softmax = speedup(ms[("sdpa", *key[1:])], ms[key])
        vs_one = speedup(ms[(row["attention"], 1, "ddp")], ms[key])
        rows.append([row["attention"].upper(), row["procs"], mode, f"{ms[key]:.1f}", fmt_x(vs_softmax), fmt_x(vs_one)])
    return [intro, "", *markdown_table(["attention", "processes", "mode", "ms/step", "speedup", "vs 1 process"], rows)]


if __name__ == "__main__":
    main()

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

import torch

from benchmarks.timing import SPEEDUP_VS_SOFTMAX, header_line, speedup, write_json
from testing.trainer_assets import write_base, write_cache
from trainer.metrics import read_metrics

REPO = Path(__file__).resolve().parent.parent
RUN = str(REPO / "trainer" / "run.py")
LOSS_RTOL = 1e-5
"""fp32 on CPU: one and two processes differ only in the order of gradient sums."""


def _train(root: Path, name: str, *, procs: int, mode: str, layers: str, args: argparse.Namespace) -> list[dict]:
    out = root / name
    flags = [
        "--model.base", str(root / "base"),
        "--data.source", "cache",
        "--data.path", str(root / "cache"),
        "--model.layers", layers,
        "--model.trainable", "all",
        "--training.batch_size", str(args.batch),
        "--training.steps", str(args.steps),
        "--checkpoint.every", "0",
        "--parallel.mode", mode,
        "--output.dir", str(out),
        "--output.progress", "false",
    ]  # fmt: skip
    launcher = [sys.executable, RUN] if procs == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}", RUN
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([*launcher, *flags], cwd=REPO, env=env, capture_output=True, text=True)
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
    print(f"tiny SD3.5-Medium-like, 24x16 latents + 7 text tokens, global batch {args.batch}, 1 thread per process")
    print(f"{'attention':9} {'procs':>5} {'mode':6} {'ms/step':>8} {'img/s':>7} {'speedup':>8} {'vs 1 proc':>9}  check")
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        write_base(root / "base")
        write_cache(root / "cache", buckets=((16, 24),), per_bucket=4 * args.batch)
        results: dict[tuple[str, int, str], list[dict]] = {}
        for attention, layers in (("sdpa", "none"), ("t5", "all")):
            for procs, mode in ((1, "ddp"), (2, "ddp"), (2, "fsdp2")):
                name = f"{attention}-{procs}-{mode}"
                results[(attention, procs, mode)] = _train(root, name, procs=procs, mode=mode, layers=layers, args=args)
        for (attention, procs, mode), metrics in results.items():
            one = [m["loss/total"] for m in results[(attention, 1, "ddp")]]
            mine = [m["loss/total"] for m in metrics]
            ok = torch.allclose(torch.tensor(mine), torch.tensor(one), rtol=LOSS_RTOL, atol=0)
            ms = 1e3 * statistics.median(m["time/step(s)"] for m in metrics[args.warmup :])
            sdpa_ms = 1e3 * statistics.median(m["time/step(s)"] for m in results[("sdpa", procs, mode)][args.warmup :])
            one_ms = 1e3 * statistics.median(m["time/step(s)"] for m in results[(attention, 1, "ddp")][args.warmup :])
            row = dict(
                attention=attention, procs=procs, mode=mode, ms_per_step=round(ms, 2), check="ok" if ok else "FAIL"
            )
            if ok:
                row.update(
                    img_per_s=round(args.batch / ms * 1e3, 2),
                    speedup_vs_softmax=round(speedup(sdpa_ms, ms), 3),
                    speedup_vs_one_process=round(speedup(one_ms, ms), 3),
                )
                print(
                    f"{attention:9} {procs:5} {mode:6} {ms:8.1f} {row['img_per_s']:7.1f} "
                    f"{row['speedup_vs_softmax']:7.2f}x {row['speedup_vs_one_process']:8.2f}x  ok"
                )
            else:
                print(f"{attention:9} {procs:5} {mode:6} {'FAIL: losses differ from one process':>40}")
            rows.append(row)
    print(f"speedup = {SPEEDUP_VS_SOFTMAX} at the same processes and mode; vs 1 proc = 1-process time / this time")
    if args.json:
        write_json("trainer_throughput", rows, meta=vars(args))


if __name__ == "__main__":
    main()

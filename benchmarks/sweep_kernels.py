"""Sweep the Triton kernels' launch settings at one SD3.5-Medium shape, against the defaults.

    python -m benchmarks.sweep_kernels                  # CUDA: 2K (128x128 + 333 text), bf16, B=2
    python -m benchmarks.sweep_kernels --grid 64x64     # 1K
    python -m benchmarks.sweep_kernels --budget-s 120   # two minutes, shared evenly by the sweeps

The defaults (`t5kernels.launch.cuda_settings`) come from compiler reports, not from timings; this
script is the timing. Three sweeps, each one T5 attention call through `t5kernels.t5_attention`
with `launch=LaunchSettings(...)` for both passes:

* `fwd`: reduction tiles x warps x pipeline stages x programs per SM (the token split), no grad;
* `map`: tokens per tile of the per-token kernels x warps, the reduction settings at their defaults;
* `bwd`: forward + backward, reduction tiles x warps x stages.

The defaults run first in each sweep. Every setting is checked against the fp32 torch reference
before it is timed; one that fails the check or does not compile or launch (shared memory,
registers) is recorded with its reason and skipped. Prints each sweep sorted by time with the
fastest against the default, and writes `benchmarks/results/kernels_sweep_<device>.json`.

Without CUDA, `TRITON_INTERPRET=1` and tiny shapes exercise the script (times mean nothing there).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from benchmarks.bench_kernels import DTYPES, AttentionCase
from benchmarks.timing import RESULTS_DIR, header_line, speedup, time_fn, write_json
from t5kernels import t5_attention, unsupported_reason
from t5kernels.launch import LaunchSettings, cuda_settings
from testing.tolerances import KERNEL_RATIO, relative_rms

SWEEPS = ("fwd", "map", "bwd")


def candidates(sweep: str, default: LaunchSettings, args: argparse.Namespace) -> Iterator[LaunchSettings]:
    """The default first, then every other combination of the sweep's lists."""
    yield default
    if sweep == "map":
        grid = itertools.product(args.map_block_n, args.warps)
        settings = (dataclasses.replace(default, map_block_n=m, num_warps=w) for m, w in grid)
    else:
        programs = args.programs_per_sm if sweep == "fwd" else [default.programs_per_sm]
        grid = itertools.product(args.block_n[sweep], args.warps, args.stages, programs)
        settings = (
            dataclasses.replace(default, block_n=b, num_warps=w, num_stages=s, programs_per_sm=p) for b, w, s, p in grid
        )
    yield from (s for s in settings if s != default)


def _forward(qkv: tuple[torch.Tensor, ...], parameters: dict, settings: LaunchSettings) -> torch.Tensor:
    return t5_attention(*qkv, **parameters, launch=settings)


def _forward_backward(qkv: tuple[torch.Tensor, ...], parameters: dict, settings: LaunchSettings, grad) -> None:
    _forward(qkv, parameters, settings).backward(grad)


def sweep_rows(sweep: str, case: AttentionCase, reference: torch.Tensor, args: argparse.Namespace, *, deadline: float):
    """Check and time each candidate of one sweep, starting none after `deadline` (the default always
    runs); returns its rows, default first."""
    dtype = DTYPES[args.dtype]
    default = cuda_settings(dtype, "bwd" if sweep == "bwd" else "fwd") if args.device == "cuda" else args.cpu_default
    parameters, qkv = case.parameters(), (case.q, case.k, case.v)
    rows = []
    for settings in candidates(sweep, default, args):
        row = {"sweep": sweep, **dataclasses.asdict(settings), "default": settings == default}
        rows.append(row)
        if time.monotonic() > deadline and not row["default"]:
            row["status"] = "not run: --budget-s spent"
            continue
        try:
            with torch.no_grad():
                row["rel_err"] = relative_rms(reference, _forward(qkv, parameters, settings).float())
            if not row["rel_err"] <= KERNEL_RATIO[dtype]:
                row["status"] = f"FAIL: relative RMS error {row['rel_err']:.1e} > {KERNEL_RATIO[dtype]:.0e}"
                continue
            if sweep == "bwd":
                leaves = tuple(x.detach().requires_grad_() for x in qkv)
                step = functools.partial(_forward_backward, leaves, parameters, settings, torch.randn_like(case.q))
            else:
                step = torch.no_grad()(functools.partial(_forward, qkv, parameters, settings))
            timing = time_fn(step, warmup=args.warmup, reps=args.reps)
        except Exception as error:  # noqa: BLE001 - a setting that cannot compile or launch is a result
            row["status"] = f"{type(error).__name__}: {str(error).strip().splitlines()[0][:160]}"
            continue
        row.update(status="ok", **timing)
    return rows


def settings_label(row: dict) -> str:
    return (
        f"tile {row['block_n']:>3} map {row['map_block_n']:>3} warps {row['num_warps']:>2} "
        f"stages {row['num_stages']} progs/SM {row['programs_per_sm']}"
    )


def print_sweep(sweep: str, rows: list[dict]) -> dict:
    """Print one sweep, fastest first; returns its summary (default and fastest)."""
    timed = sorted((r for r in rows if r["status"] == "ok"), key=lambda r: r["median_ms"])
    default = next(r for r in rows if r["default"])
    print(f"\n{sweep}: {len(timed)} of {len(rows)} settings timed")
    for row in timed:
        mark = "  <- default" if row["default"] else ""
        print(f"  {settings_label(row)}  {row['median_ms']:9.3f} ms  (p20 {row['p20_ms']:.3f}){mark}")
    for row in rows:
        if row["status"] != "ok":
            print(f"  {settings_label(row)}  {row['status']}")
    summary = {"sweep": sweep, "default_status": default["status"]}
    if timed and default["status"] == "ok":
        best = timed[0]
        summary.update(
            default_ms=default["median_ms"],
            best_ms=best["median_ms"],
            best={field.name: best[field.name] for field in dataclasses.fields(LaunchSettings)},
            speedup_vs_default=speedup(default["median_ms"], best["median_ms"]),
        )
        print(
            f"  fastest: {settings_label(best)}, speedup vs the default (default time / its time) "
            f"{summary['speedup_vs_default']:.2f}x"
        )
    return summary


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--grid", help="image token grid HxW (default: 128x128 on CUDA, 5x7 on CPU)")
    parser.add_argument("--text", type=int, help="text tokens (default: 333 on CUDA, 6 on CPU)")
    parser.add_argument("--batch", type=int, default=2, help="batch (2 = one CFG pair)")
    parser.add_argument("--heads", type=int, help="heads (default: 24 on CUDA, 2 on CPU)")
    parser.add_argument("--head-dim", type=int, help="head dim (default: 64 on CUDA, 16 on CPU)")
    parser.add_argument("--dtype", choices=list(DTYPES), help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--sweeps", nargs="+", choices=SWEEPS, default=list(SWEEPS))
    parser.add_argument("--fwd-block-n", type=int_list, default=[32, 64, 128], help="reduction tiles, forward")
    parser.add_argument("--bwd-block-n", type=int_list, default=[16, 32, 64], help="reduction tiles, backward")
    parser.add_argument("--map-block-n", type=int_list, default=[16, 32, 64, 128], help="per-token tiles")
    parser.add_argument("--warps", type=int_list, default=[4, 8])
    parser.add_argument("--stages", type=int_list, default=[1, 2, 3])
    parser.add_argument("--programs-per-sm", type=int_list, default=[1, 2, 4])
    parser.add_argument("--reps", type=int, help="timed repetitions (default: 10 on CUDA, 2 on CPU)")
    parser.add_argument("--warmup", type=int, help="untimed calls first (default: 3 on CUDA, 0 on CPU)")
    parser.add_argument(
        "--budget-s", type=float, default=240.0, help="seconds for all sweeps, split evenly; none starts a setting late"
    )
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR, help="where the JSON goes")
    args = parser.parse_args()
    cuda = args.device == "cuda"
    args.grid = args.grid or ("128x128" if cuda else "5x7")
    args.text = args.text if args.text is not None else (333 if cuda else 6)
    args.heads = args.heads or (24 if cuda else 2)
    args.head_dim = args.head_dim or (64 if cuda else 16)
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    args.reps = args.reps or (10 if cuda else 2)
    args.warmup = args.warmup if args.warmup is not None else (3 if cuda else 0)
    args.block_n = {"fwd": args.fwd_block_n, "bwd": args.bwd_block_n}
    # the interpreter has no defaults of its own to compare with; one small setting stands in
    args.cpu_default = LaunchSettings(block_n=16, map_block_n=16, num_warps=4, num_stages=1)
    return args


def main() -> None:
    args = parse_args()
    side_h, side_w = (int(x) for x in args.grid.lower().split("x"))
    case = AttentionCase(side_h, side_w, args)
    reason = unsupported_reason(case.q, variant=case.module.variant)
    if reason is not None:
        raise SystemExit(f"the kernels cannot run here: {reason}")
    print(header_line())
    print(
        f"T5 attention launch sweep: B={args.batch}, {args.heads} heads x {args.head_dim}, grid {args.grid}, "
        f"text {args.text} last, {args.dtype}, swiglu, locality, key norm; budget {args.budget_s:.0f} s"
    )
    reference = case.reference()
    share_s = args.budget_s / len(args.sweeps)
    rows, summaries = [], []
    for sweep in args.sweeps:
        sweep_result = sweep_rows(sweep, case, reference, args, deadline=time.monotonic() + share_s)
        rows += sweep_result
        summaries.append(print_sweep(sweep, sweep_result))
    meta = {key: value for key, value in vars(args).items() if key not in ("results_dir", "cpu_default")}
    meta["summaries"] = summaries
    path = write_json(f"kernels_sweep_{args.device}", rows, meta, directory=args.results_dir)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()

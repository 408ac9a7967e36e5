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
registers) is recorded with its reason and skipped. Prints each sweep's default against its
fastest setting, and writes `benchmarks/results/kernels_sweep_<device>.json`.

Without CUDA, `TRITON_INTERPRET=1` and tiny shapes exercise the script (times mean nothing there).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import time
from collections.abc import Iterator
from typing import Any

import torch

from benchmarks.cases import DTYPES, AttentionCase, add_case_arguments, grid_of
from benchmarks.timing import fmt_ms, fmt_x, header_line, markdown_table, publish, speedup, time_fn
from t5kernels import t5_attention, unsupported_reason
from t5kernels.launch import LaunchSettings, cuda_settings
from testing.tolerances import KERNEL_RATIO, relative_rms

TITLE = "Kernel launch settings"
SWEEPS = ("fwd", "map", "bwd")
FIELDS = tuple(field.name for field in dataclasses.fields(LaunchSettings))
"""The launch settings' fields, in the order the table names them."""


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


def sweep_rows(sweep: str, case: AttentionCase, reference: torch.Tensor, args: argparse.Namespace, *, deadline: float):
    """Check and time each candidate of one sweep, starting none after `deadline` (the default always
    runs); returns its rows, default first."""
    dtype = DTYPES[args.dtype]
    default = cuda_settings(dtype, "bwd" if sweep == "bwd" else "fwd") if args.device == "cuda" else args.cpu_default
    rows = []
    for settings in candidates(sweep, default, args):
        row = {"sweep": sweep, **dataclasses.asdict(settings), "default": settings == default}
        rows.append(row)
        if time.monotonic() > deadline and not row["default"]:
            row["status"] = "not run: --budget-s spent"
            continue
        attention = functools.partial(t5_attention, **case.parameters(), launch=settings)
        try:
            row["rel_err"] = relative_rms(reference, case.forward(attention)().float())
            if not row["rel_err"] <= KERNEL_RATIO[dtype]:
                row["status"] = f"FAIL: relative RMS error {row['rel_err']:.1e} > {KERNEL_RATIO[dtype]:.0e}"
                continue
            step = case.forward_backward(attention) if sweep == "bwd" else case.forward(attention)
            timing = time_fn(step, warmup=args.warmup, reps=args.reps)
        except Exception as error:  # noqa: BLE001 - a setting that cannot compile or launch is a result
            row["status"] = f"{type(error).__name__}: {str(error).strip().splitlines()[0][:160]}"
            continue
        row.update(status="ok", **timing)
    return rows


def _label(row: dict[str, Any]) -> str:
    return ", ".join(f"{name} {row[name]}" for name in FIELDS)


def summary(sweep: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One sweep's default and fastest setting."""
    timed = sorted((r for r in rows if r["status"] == "ok"), key=lambda r: r["median_ms"])
    default = next(r for r in rows if r["default"])
    result = {"sweep": sweep, "default_status": default["status"], "timed": len(timed), "settings": len(rows)}
    if timed and default["status"] == "ok":
        default_ms, best = default["median_ms"], timed[0]
        result.update(default_ms=default_ms, best_ms=best["median_ms"], best={name: best[name] for name in FIELDS})
        result["speedup_vs_default"] = speedup(default_ms, best["median_ms"])
    return result


def table(result: dict[str, Any]) -> list[str]:
    """The markdown table: per sweep, the default against the fastest setting."""
    meta = result["meta"]
    grid = "x".join(map(str, meta["grid"]))
    intro = (
        f"Launch settings of the kernels at grid {grid} + {meta['text']} text tokens, {meta['dtype']}: the "
        "defaults against the fastest setting each sweep found (speedup vs the default = default time / its time)."
    )
    rows = [
        [s["sweep"], fmt_ms(s["default_ms"]), fmt_ms(s["best_ms"]), fmt_x(s["speedup_vs_default"]), _label(s["best"])]
        if "best_ms" in s
        else [s["sweep"], s["default_status"], "", "", ""]
        for s in meta["summaries"]
    ]
    header = ["sweep", "default ms", "fastest ms", "speedup vs default", "fastest"]
    failed = [f"* {row['sweep']}, {_label(row)}: {row['status']}" for row in result["rows"] if row["status"] != "ok"]
    return [intro, "", *markdown_table(header, rows), *([""] + failed if failed else [])]


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--grid", type=grid_of, help="image token grid HxW (default: 128x128 on CUDA, 5x7 on CPU)")
    # defaults per device: 24 heads x 64 and 333 text tokens on CUDA, 2 x 16 and 6 on CPU
    add_case_arguments(parser, heads=None, text=None, batch=2, head_dim=None)
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
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    args.grid = args.grid or ((128, 128) if cuda else (5, 7))
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


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    case = AttentionCase(args.grid, args)
    if (reason := unsupported_reason(case.q, variant=case.module.variant)) is not None:
        raise SystemExit(f"the kernels cannot run here: {reason}")
    print(header_line())
    reference = case.reference()
    share_s = args.budget_s / len(args.sweeps)
    rows, summaries = [], []
    for sweep in args.sweeps:
        sweep_result = sweep_rows(sweep, case, reference, args, deadline=time.monotonic() + share_s)
        rows += sweep_result
        summaries.append(summary(sweep, sweep_result))
    meta = {key: value for key, value in vars(args).items() if key not in ("results_dir", "cpu_default")}
    meta["summaries"] = summaries
    publish(f"kernels_sweep_{args.device}", rows, meta, table=table, directory=args.results_dir)


if __name__ == "__main__":
    main()

"""Toy sampling speed: the softmax teacher vs its T5 conversion, at two resolutions, as ratios.

    python -m benchmarks.bench_toy_speed                       # 48 and 96 px, 4 Euler steps with CFG
    python -m benchmarks.bench_toy_speed --sizes 48 96 --steps 8 --batch 4

Both models are the shipped toy teacher; the T5 one is converted with the `paper` spec (fresh T5
parameters: speed does not depend on their values) and the `auto` backend (Triton on CUDA, the torch
reference on CPU). Before timing, each size is checked: the T5 samples must be finite and, where `auto`
picked a kernel, match the torch reference path. Softmax and T5 are timed in turn, round by round
(`benchmarks.timing.time_in_turn`), so both see the same load on a shared host; the speedup is the
median of the rounds' own softmax time / T5 time, so above 1 means T5 is faster.
"""

from __future__ import annotations

import argparse
import copy
import logging
from functools import partial
from pathlib import Path
from typing import Any

import torch

from benchmarks.timing import (
    RESULTS_DIR,
    fmt_ms,
    fmt_x,
    header_line,
    markdown_table,
    publish,
    speedup,
    spread,
    summarize,
    time_in_turn,
)
from sd3_testbed.data import LATENT_CHANNELS, all_captions
from sd3_testbed.model import ToyCond, load_toy_base
from t5core.hosts.diffusers import linearize
from trainer.sampling import sample

TITLE = "Toy sampling speed"
CHECK_ATOL = 2e-2
"""Kernel vs torch path on whole samples after a few Euler steps (fp32 compute; kernels may
reduce in a different order, and the ODE integrates small differences)."""


def _inputs(size: int, batch: int, device: torch.device) -> tuple[ToyCond, torch.Tensor]:
    cond = ToyCond.from_captions([str(c) for c in all_captions()[:batch]])
    cond = ToyCond(*(t.to(device) for t in (cond.context, cond.pooled, cond.context_uncond, cond.pooled_uncond)))
    gen = torch.Generator().manual_seed(size)
    noise = torch.randn(batch, LATENT_CHANNELS, size // 2, size // 2, generator=gen).to(device)
    return cond, noise


def _check(t5_model, torch_model, cond: ToyCond, noise: torch.Tensor, steps: int) -> str | None:
    """None when the T5 samples are finite and agree with the torch reference path, else why not."""
    out = sample(t5_model, cond, noise, steps=steps)
    if not torch.isfinite(out).all():
        return "T5 samples are not finite"
    reference = sample(torch_model, cond, noise, steps=steps)
    error = (out - reference).abs().max().item()
    return None if error <= CHECK_ATOL else f"T5 auto vs torch path differ by {error:.3g} > {CHECK_ATOL}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", type=int, default=[48, 96], help="image sides in pixels (x16)")
    parser.add_argument("--steps", type=int, default=4, help="Euler steps per sampling run (with CFG)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--reps", type=int, default=10, help="timed rounds (softmax then T5 in each)")
    parser.add_argument("--json", default="bench_toy_speed", help="the result file's name")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR, help="where the JSON goes")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    softmax = load_toy_base().to(device)
    t5 = copy.deepcopy(softmax)
    torch.manual_seed(0)
    handle = linearize(t5, layers="paper", backend="auto")
    # The same conversion on the torch reference path, with the same T5 parameters, for the check.
    reference = copy.deepcopy(softmax)
    reference_handle = linearize(reference, layers="paper", backend="torch")
    for name, module in handle.modules.items():
        reference_handle.modules[name].load_state_dict(module.state_dict())

    print(header_line())
    rows = []
    for size in args.sizes:
        cond, noise = _inputs(size, args.batch, device)
        problem = _check(t5, reference, cond, noise, args.steps)
        row = {"size": size, "image_tokens": (size // 4) ** 2}
        if problem is not None:
            rows.append({**row, "status": "FAIL", "reason": problem})
            continue
        run = partial(sample, cond=cond, noise=noise, steps=args.steps)
        times = time_in_turn({"softmax": partial(run, softmax), "t5": partial(run, t5)}, rounds=args.reps)
        ratios = [speedup(s, f) for s, f in zip(times["softmax"], times["t5"], strict=True)]
        ratio, ratio_p20, ratio_p80 = spread(ratios)
        row.update(softmax=summarize(times["softmax"]), t5=summarize(times["t5"]), speedup_vs_softmax=ratio)
        rows.append({**row, "speedup_p20": ratio_p20, "speedup_p80": ratio_p80, "times_ms": times})
    meta = {"steps": args.steps, "batch": args.batch, "rounds": args.reps, "layers": list(handle.config.layers)}
    publish(args.json, rows, meta, table=table, directory=args.results_dir)
    return 0


def table(result: dict[str, Any]) -> list[str]:
    """The markdown table: per size, softmax and T5 ms and the per-round speedup."""
    meta = result["meta"]
    intro = (
        f"Sampling the built-in toy ({meta['steps']} Euler steps with CFG, batch {meta['batch']}): the softmax "
        f"teacher against its T5 conversion ({len(meta['layers'])} modules), timed in turn over "
        f"{meta['rounds']} rounds; times are medians over the rounds, the speedup is the median of the "
        "rounds' own ratios (20-80 % of them in brackets)."
    )
    rows = []
    for row in result["rows"]:
        head = [f"{row['size']} px", row["image_tokens"]]
        if "t5" not in row:
            rows.append([*head, row.get("status", "FAIL")])
            continue
        ratio = f"{fmt_x(row['speedup_vs_softmax'])} ({row['speedup_p20']:.2f}-{row['speedup_p80']:.2f})"
        rows.append([*head, fmt_ms(row["softmax"]["median_ms"]), fmt_ms(row["t5"]["median_ms"]), ratio])
    return [intro, "", *markdown_table(["image", "image tokens", "softmax ms", "T5 ms", "speedup"], rows)]


if __name__ == "__main__":
    raise SystemExit(main())

"""Toy sampling speed: the softmax teacher vs its T5 conversion, at two resolutions, as ratios.

    python -m benchmarks.bench_toy_speed                       # 48 and 96 px, 4 Euler steps with CFG
    python -m benchmarks.bench_toy_speed --sizes 48 96 --steps 8 --batch 4

Both models are the shipped toy teacher; the T5 one is converted with the `paper` spec (fresh T5
parameters: speed does not depend on their values) and the `auto` backend (Triton on CUDA, the
torch reference on CPU). Before timing, each size is checked: the T5 samples must be finite and,
where `auto` picked a kernel, match the torch reference path. Softmax and T5 are timed in turn, round by round
(`benchmarks.timing.time_in_turn`), so both see the same load on a shared host. Rows report
milliseconds per sampling run (median over the rounds, p20-p80) and the speedup vs softmax: the median
over the rounds of that round's softmax time / T5 time (p20-p80 beside it), so above 1 means T5 is
faster.
"""

from __future__ import annotations

import argparse
import copy
import logging
from functools import partial

import torch

from benchmarks.timing import SPEEDUP_VS_SOFTMAX, header_line, speedup, spread, summarize, time_in_turn, write_json
from sd3_testbed.data import LATENT_CHANNELS, all_captions
from sd3_testbed.model import ToyCond, load_toy_base
from t5core.hosts.diffusers import linearize
from trainer.sampling import sample

logger = logging.getLogger(__name__)

CHECK_ATOL = 2e-2
"""Kernel vs torch path on whole samples after a few Euler steps (fp32 compute; kernels may
reduce in a different order, and the ODE integrates small differences)."""


def _inputs(size: int, batch: int, device: torch.device) -> tuple[ToyCond, torch.Tensor]:
    captions = [str(c) for c in all_captions()[:batch]]
    cond = ToyCond.from_captions(captions)
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
    parser.add_argument("--json", default="bench_toy_speed")
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
    layers = ",".join(handle.config.layers)
    print(f"toy sampling, {args.steps} Euler steps with CFG, batch {args.batch}, T5 layers: {layers}")
    print(f"{'size':>6} {'tokens':>7} {'softmax ms':>16} {'T5 ms':>16} {'speedup (p20-p80)':>21}")
    rows = []
    for size in args.sizes:
        cond, noise = _inputs(size, args.batch, device)
        problem = _check(t5, reference, cond, noise, args.steps)
        tokens = (size // 4) ** 2
        if problem is not None:
            print(f"{size:>6} {tokens:>7} FAIL: {problem}")
            rows.append({"size": size, "image_tokens": tokens, "status": "FAIL", "reason": problem})
            continue
        times = time_in_turn(
            {
                model: partial(sample, net, cond, noise, steps=args.steps)
                for model, net in (("softmax", softmax), ("t5", t5))
            },
            rounds=args.reps,
        )
        soft, fast = summarize(times["softmax"]), summarize(times["t5"])
        ratio, ratio_p20, ratio_p80 = spread(
            [speedup(s, f) for s, f in zip(times["softmax"], times["t5"], strict=True)]
        )
        print(
            f"{size:>6} {tokens:>7} {soft['median_ms']:>8.1f} ({soft['p20_ms']:.0f}-{soft['p80_ms']:.0f})"
            f" {fast['median_ms']:>8.1f} ({fast['p20_ms']:.0f}-{fast['p80_ms']:.0f})"
            f" {ratio:>8.2f}x ({ratio_p20:.2f}-{ratio_p80:.2f})"
        )
        rows.append(
            {
                "size": size,
                "image_tokens": tokens,
                "softmax": soft,
                "t5": fast,
                "speedup_vs_softmax": ratio,
                "speedup_p20": ratio_p20,
                "speedup_p80": ratio_p80,
                "times_ms": times,
            }
        )
    print(f"speedup = {SPEEDUP_VS_SOFTMAX}, per round; {args.reps} rounds")
    write_json(
        args.json,
        rows,
        meta={"steps": args.steps, "batch": args.batch, "rounds": args.reps, "layers": list(handle.config.layers)},
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

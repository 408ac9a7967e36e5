"""Hybrid joint attention (exact text beside T5) against PyTorch SDPA over all tokens: time and growth.

    python -m benchmarks.bench_hybrid_attention                 # 4096 and 16384 image tokens + 154 text
    python -m benchmarks.bench_hybrid_attention --tokens 1024 4096 --no-backward

A joint attention call as SD3.5 Medium makes it with CFG's prompt: B=1, 24 heads x 64, a square
image grid plus 154 text tokens first (ComfyUI's order). Paths: `sdpa` (softmax over all tokens,
`F.scaled_dot_product_attention`), `t5` (T5 attention over all tokens, the `paper` joint mode) and
`hybrid` (`T5Attention(exact_text=True)`: softmax wherever text takes part, T5 between image tokens)
and `hybrid_na` (the same with the 5x5 neighbourhood softmax blended into the image rows,
`neighborhood=5`), all on the torch backend with T5Attention's initial parameters. Forward without autograd, and
forward + backward (a random output gradient, all of q, k, v and the T5 parameters).

Each shape is checked first: the hybrid's text rows must equal SDPA's (relative RMS error <= 1e-5),
else the row reads FAIL. Times are medians over `--rounds` rounds that time every path in turn
(`bench_attention.timings_in_turn`). Ratio = T5 time / SDPA time (the "fraction of SDPA's time";
its inverse is the speedup vs softmax); growth = time at N / time at the previous N. Rows go
to `benchmarks/results/hybrid_attention_<device>.json`.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from benchmarks.bench_attention import add_call_arguments, timings_in_turn
from benchmarks.timing import SPEEDUP_VS_SOFTMAX, header_line, speedup, write_json
from t5core import T5Attention
from testing.tolerances import relative_rms

TEXT_TOKENS = 154
"""SD3.5's prompt length in ComfyUI: 77 CLIP + 77 T5 tokens."""
PATHS = ("sdpa", "t5", "hybrid", "hybrid_na")
T5_PATHS = PATHS[1:]


def make_case(
    n_image: int, args: argparse.Namespace
) -> tuple[dict[str, Callable[[], Tensor]], dict[str, Callable[[], None]], float]:
    """Forward and forward+backward callables per path on one set of inputs, and the text-row check."""
    side = math.isqrt(n_image)
    if side * side != n_image:
        raise SystemExit(f"--tokens must be square numbers of image tokens; got {n_image}.")
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    generator = torch.Generator().manual_seed(0)
    shape = (1, n_image + args.text, args.heads, args.head_dim)
    q, k, v = (torch.randn(shape, generator=generator).to(device, dtype) for _ in range(3))
    grad = torch.randn(shape, generator=generator).to(device, dtype)
    torch.manual_seed(0)
    modules = {
        "t5": T5Attention(args.heads, args.head_dim, backend=args.backend).to(device),
        "hybrid": T5Attention(args.heads, args.head_dim, backend=args.backend, exact_text=True).to(device),
        "hybrid_na": T5Attention(args.heads, args.head_dim, backend=args.backend, exact_text=True, neighborhood=5).to(
            device
        ),
    }
    for name in ("hybrid", "hybrid_na"):
        modules[name].load_state_dict(modules["t5"].state_dict())
    layout = dict(grid=(side, side), text_tokens=args.text, text_first=True)

    def sdpa(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v))).transpose(1, 2)

    calls: dict[str, Callable[[Tensor, Tensor, Tensor], Tensor]] = {
        "sdpa": sdpa,
        **{name: (lambda q, k, v, m=module: m(q, k, v, **layout)) for name, module in modules.items()},
    }

    def forward(name: str) -> Callable[[], Tensor]:
        def run() -> Tensor:
            with torch.no_grad():
                return calls[name](q, k, v)

        return run

    def backward(name: str) -> Callable[[], None]:
        def run() -> None:
            leaves = [x.detach().requires_grad_() for x in (q, k, v)]
            calls[name](*leaves).backward(grad)

        return run

    text_error = relative_rms(forward("sdpa")()[:, : args.text], forward("hybrid")()[:, : args.text])
    return {p: forward(p) for p in PATHS}, {p: backward(p) for p in PATHS}, text_error


def measure(n_image: int, args: argparse.Namespace, previous: dict | None) -> dict:
    forwards, backwards, error = make_case(n_image, args)
    row: dict = {"image_tokens": n_image, "text_tokens": args.text, "text_rows_rel_error": error}
    if not error <= 1e-5:
        return {**row, "status": "FAIL"}
    row["status"] = "ok"
    passes = {"fwd": forwards, **({"fwdbwd": backwards} if args.backward else {})}
    for kind, fns in passes.items():
        for path, timing in timings_in_turn(fns, args.rounds).items():
            row[f"{kind}_{path}_ms"] = timing["median_ms"]
            row[f"{kind}_{path}_p20_ms"], row[f"{kind}_{path}_p80_ms"] = timing["p20_ms"], timing["p80_ms"]
            if previous and f"{kind}_{path}_ms" in previous:
                row[f"{kind}_{path}_growth"] = row[f"{kind}_{path}_ms"] / previous[f"{kind}_{path}_ms"]
        for path in T5_PATHS:
            row[f"{kind}_{path}_fraction_of_sdpa"] = row[f"{kind}_{path}_ms"] / row[f"{kind}_sdpa_ms"]
            row[f"{kind}_{path}_speedup_vs_sdpa"] = speedup(row[f"{kind}_sdpa_ms"], row[f"{kind}_{path}_ms"])
    return row


def print_rows(rows: list[dict]) -> None:
    print(f"{'image N':>8} {'pass':>7} {'sdpa ms':>10} {'t5 ms':>9} {'hybrid ms':>10} {'hyb+na ms':>10} "
          f"{'t5/sdpa':>8} {'hyb/sdpa':>8} {'h+na/sdpa':>9} {'hyb speedup':>11} {'hyb growth':>10}")  # fmt: skip
    for row in rows:
        if row["status"] != "ok":
            print(
                f"{row['image_tokens']:>8} FAIL: hybrid text rows differ from SDPA ({row['text_rows_rel_error']:.1e})"
            )
            continue
        for kind in ("fwd", "fwdbwd"):
            if f"{kind}_sdpa_ms" not in row:
                continue
            growth = row.get(f"{kind}_hybrid_growth")
            print(
                f"{row['image_tokens']:>8} {kind:>7} {row[f'{kind}_sdpa_ms']:>10.1f} {row[f'{kind}_t5_ms']:>9.1f} "
                f"{row[f'{kind}_hybrid_ms']:>10.1f} {row[f'{kind}_hybrid_na_ms']:>10.1f} "
                f"{row[f'{kind}_t5_fraction_of_sdpa']:>8.3f} {row[f'{kind}_hybrid_fraction_of_sdpa']:>8.3f} "
                f"{row[f'{kind}_hybrid_na_fraction_of_sdpa']:>9.3f} {row[f'{kind}_hybrid_speedup_vs_sdpa']:>10.2f}x "
                + (f"{growth:>10.2f}" if growth else f"{'-':>10}")
            )


def goals(rows: list[dict]) -> list[str]:
    """The hybrid's goals on the CPU torch path, checked on these rows."""
    largest = max((r for r in rows if r["status"] == "ok"), key=lambda r: r["image_tokens"], default=None)
    if largest is None:
        return []
    lines = []
    for kind in ("fwd", "fwdbwd"):
        if f"{kind}_hybrid_ms" not in largest:
            continue
        fraction = largest[f"{kind}_hybrid_fraction_of_sdpa"]
        line = (
            f"{kind}: hybrid at {largest['image_tokens']} image tokens takes {fraction:.3f} of SDPA's time (goal "
            f"<= 0.06; with the neighbourhood blend {largest[f'{kind}_hybrid_na_fraction_of_sdpa']:.3f})"
        )
        growth = largest.get(f"{kind}_hybrid_growth")
        if growth is not None:
            line += f", growth {growth:.2f}x from the previous N (goal <= 5)"
        lines.append(line)
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384], help="image tokens (square grids)")
    parser.add_argument("--text", type=int, default=TEXT_TOKENS, help="text tokens (first)")
    add_call_arguments(parser)
    parser.add_argument("--backend", default="auto", choices=["auto", "torch", "triton"], help="T5 backend")
    parser.add_argument("--no-backward", dest="backward", action="store_false", help="time the forward only")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    print(header_line())
    print(
        f"joint attention, hybrid vs SDPA | B=1, {args.heads} heads x {args.head_dim}, {args.dtype}, "
        f"{args.text} text tokens first, {torch.get_num_threads()} threads, load average {load_before[0]:.2f}"
    )
    rows: list[dict] = []
    for n in args.tokens:
        previous = rows[-1] if rows and rows[-1]["status"] == "ok" else None
        rows.append(measure(n, args, previous))
    print_rows(rows)
    print(f"'t5/sdpa', 'hyb/sdpa': T5 time / SDPA time; 'speedup': {SPEEDUP_VS_SOFTMAX}; growth from the previous N.")
    for line in goals(rows):
        print("goal:", line)
    load_after = os.getloadavg()
    print(f"load average (1 min) before {load_before[0]:.2f}, after {load_after[0]:.2f}")
    meta = {
        "heads": args.heads,
        "head_dim": args.head_dim,
        "dtype": args.dtype,
        "batch": 1,
        "threads": torch.get_num_threads(),
        "load_average_before": load_before,
        "load_average_after": load_after,
        "goals": goals(rows),
    }
    print(f"wrote {write_json(f'hybrid_attention_{args.device}', rows, meta)}")


if __name__ == "__main__":
    main()

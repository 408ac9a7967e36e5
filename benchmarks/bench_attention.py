"""The torch paths of T5 attention against PyTorch SDPA: time, speedup, growth with N, and peak memory.

    python -m benchmarks.bench_attention                     # N = 4096, 16384; B=1, 24 heads x 64; 2 threads
    python -m benchmarks.bench_attention --tokens 1024 4096 --chunk-sweep 512 1024 2048

Paths: `sdpa` (`F.scaled_dot_product_attention`), `ref` (`t5core.ttt.t5_attention_ref`, the plain
reference) and `chunked` (`t5core.ttt_chunked.t5_attention_chunked`), forward only, without autograd,
on a square image grid with no text (SD3.5 Medium's image-only `attn2` shape) and T5Attention's
initial parameters. Each shape is checked first: the chunked output must match the reference
(relative RMS error <= 1e-5 in fp32), else the row reads FAIL.

Time: after one warm-up call of each path, `--rounds` rounds each time every path in turn (the median
of two calls, `benchmarks.timing.time_in_turn`), and a path's time is the median over the rounds (with 20 / 80 %
quantiles). On a machine other jobs share, the paths so see the same load; the load average is
printed. Speedup vs SDPA = SDPA time / T5 time (> 1: T5 is faster); growth = time at N / time at
the previous N.

Peak memory: the most memory one call holds at once above its inputs and output (MiB), as
`testing.peak_memory.peak_memory_mib` measures it: CUDA's allocator peak, or on CPU the profiler's
record of every allocation, which counts the tensors themselves, not the process RSS, so unlike time
it is not disturbed by load.

Resident memory, as users see it: the rise of the process's peak resident set (`VmHWM`) that one
call causes, measured in two child processes that build the same inputs: one runs the call, the other
only allocates and fills an output of the same size, and the row is the difference. Unlike the peak
above, it includes what the allocator keeps or fragments, thread pools and the code the call loads.
It reads `VmHWM`, not `ru_maxrss`: Linux carries `ru_maxrss` across a spawned child's `exec`, so both
children would report this process's resident set at the fork (every row would read 0 MiB).

`--chunk-sweep` also times the chunked path (in turn, as above) and measures its peak at the largest
N for each chunk size given (the choice of `t5core.ttt_chunked.DEFAULT_CHUNK_TOKENS`). The table is
printed with the chunked path's goals (peak <= 2 inputs, speedup >= 10, growth 4096 -> 16384 <= 5)
and the load average; rows go to `benchmarks/results/attention_<device>.json`.
"""

from __future__ import annotations

import argparse
import functools
import math
import multiprocessing
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from benchmarks.step_probes import peak_resident_mib
from benchmarks.timing import SPEEDUP_VS_SOFTMAX, header_line, speedup, summarize, time_in_turn, write_json
from t5core import T5Attention
from t5core.ttt import t5_attention_ref
from t5core.ttt_chunked import DEFAULT_CHUNK_TOKENS, t5_attention_chunked
from testing.peak_memory import peak_memory_mib
from testing.tolerances import CHUNKED_RATIO, relative_rms

PATHS = ("sdpa", "ref", "chunked")
RESIDENT_PATHS = ("sdpa", "chunked")
"""The paths whose resident memory is measured (`ref` holds whole-sequence intermediates by design)."""


def make_case(n: int, args: argparse.Namespace) -> tuple[dict[str, Callable[..., Tensor]], Callable[[], float]]:
    """The three paths on one set of inputs (each takes `chunk_tokens`, used by `chunked` only) and a
    check that returns the chunked path's relative RMS error against the reference."""
    side = math.isqrt(n)
    if side * side != n:
        raise SystemExit(f"--tokens {n}: use square numbers (a side x side grid).")
    dtype = getattr(torch, args.dtype)
    generator = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(1, n, args.heads, args.head_dim, generator=generator).to(args.device, dtype) for _ in range(3)
    )
    torch.manual_seed(0)
    module = T5Attention(args.heads, args.head_dim).to(args.device)
    call = dict(
        weights=tuple(w.detach() for w in module.fast_weights()),
        q_conv=(module.q_conv.weight.detach(), module.q_conv.bias.detach()),
        k_conv=(module.k_conv.weight.detach(), module.k_conv.bias.detach()),
        grid=(side, side),
    )
    q_BHND, k_BHND, v_BHND = (x.transpose(1, 2) for x in (q, k, v))

    @torch.no_grad()
    def run_sdpa(chunk_tokens: int = 0) -> Tensor:
        return F.scaled_dot_product_attention(q_BHND, k_BHND, v_BHND).transpose(1, 2)

    @torch.no_grad()
    def run_ref(chunk_tokens: int = 0) -> Tensor:
        return t5_attention_ref(q, k, v, **call)

    @torch.no_grad()
    def run_chunked(chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> Tensor:
        return t5_attention_chunked(q, k, v, chunk_tokens=chunk_tokens, **call)

    def check() -> float:
        ref, out = run_ref(), run_chunked()
        return relative_rms(ref, out) if torch.isfinite(out).all() else math.inf

    return {"sdpa": run_sdpa, "ref": run_ref, "chunked": run_chunked}, check


def _resident_child(path: str, n: int, args: argparse.Namespace, conn) -> None:
    """In a fresh process: build the inputs at `n`, then run the `path` call, or for `path=None` only fill
    an output of its size; send the peak resident set in MiB."""
    if args.threads:
        torch.set_num_threads(args.threads)
    fns, _ = make_case(n, args)
    out = fns[path]() if path else torch.ones(1, n, args.heads, args.head_dim, dtype=getattr(torch, args.dtype))
    conn.send(peak_resident_mib())
    del out


def resident_rise_mib(path: str, n: int, args: argparse.Namespace) -> float:
    """How far one `path` call at `n` tokens raises the peak resident set of a process holding its inputs
    and output, in MiB: the peak resident set (`VmHWM`) of a child that runs it less that of one that does
    not (module docstring). CPU only."""
    context = multiprocessing.get_context("spawn")
    peaks = []
    for child_path in (path, None):
        receive, send = context.Pipe(duplex=False)
        child = context.Process(target=_resident_child, args=(child_path, n, args, send))
        child.start()
        peak = receive.recv()
        child.join()
        if child.exitcode != 0:
            raise RuntimeError(f"the resident-memory child for {child_path or 'the baseline'} exited {child.exitcode}.")
        peaks.append(peak)
    return peaks[0] - peaks[1]


def timings_in_turn(fns: dict, rounds: int) -> dict:
    """`{"median_ms", "p20_ms", "p80_ms"}` per path over rounds that time every path in turn (two calls each)."""
    return {path: summarize(times) for path, times in time_in_turn(fns, rounds=rounds, calls=2).items()}


def measure(n: int, args: argparse.Namespace, previous: dict | None) -> dict:
    """One row: check, then time and peak memory of every path, speedups and growth."""
    fns, check = make_case(n, args)
    error = check()
    dtype = getattr(torch, args.dtype)
    row: dict = {"tokens": n, "chunked_rel_error": error}
    if not error <= CHUNKED_RATIO[dtype]:
        return {**row, "status": "FAIL"}
    row["status"] = "ok"
    row["input_mib"] = n * args.heads * args.head_dim * dtype.itemsize / 2**20
    for path, timing in timings_in_turn(fns, args.rounds).items():
        row.update({f"{path}_{key}": value for key, value in timing.items()})
        row[f"{path}_peak_mib"] = peak_memory_mib(fns[path], args.device)
        row[f"{path}_growth"] = row[f"{path}_median_ms"] / previous[f"{path}_median_ms"] if previous else None
    if args.device == "cpu":
        row.update({f"{path}_resident_mib": resident_rise_mib(path, n, args) for path in RESIDENT_PATHS})
    for path in ("ref", "chunked"):
        row[f"{path}_speedup_vs_sdpa"] = speedup(row["sdpa_median_ms"], row[f"{path}_median_ms"])
    return row


def sweep_chunks(n: int, sizes: list[int], args: argparse.Namespace) -> list[dict]:
    """Time and peak memory of the chunked path at `n` tokens for each chunk size."""
    fns, _ = make_case(n, args)
    chunked = {size: functools.partial(fns["chunked"], size) for size in sizes}
    rows = []
    for size, timing in timings_in_turn(chunked, args.rounds).items():
        rows.append(
            {"tokens": n, "chunk_tokens": size, **timing, "peak_mib": peak_memory_mib(chunked[size], args.device)}
        )
        print(f"{n:>6} {size:>7} {timing['median_ms']:>10.1f} {rows[-1]['peak_mib']:>9.0f}", flush=True)
    return rows


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_row(row: dict) -> None:
    if row["status"] != "ok":
        print(f"{row['tokens']:>6} FAIL: chunked vs reference relative RMS error {row['chunked_rel_error']:.2e}")
        return
    times = " ".join(f"{row[f'{path}_median_ms']:>9.1f}" for path in PATHS)
    speedups = " ".join(f"{row[f'{path}_speedup_vs_sdpa']:>7.2f}x" for path in ("ref", "chunked"))
    growth = " ".join(f"{_fmt(row[f'{path}_growth'], '.2f'):>6}" for path in PATHS)
    peaks = " ".join(f"{row[f'{path}_peak_mib']:>7.0f}" for path in PATHS)
    resident = " ".join(f"{_fmt(row.get(f'{path}_resident_mib'), '.0f'):>7}" for path in RESIDENT_PATHS)
    print(f"{row['tokens']:>6} {times} {speedups} {growth} {peaks} {resident}")


def goals(rows: list[dict]) -> list[str]:
    """The chunked path's goals, checked on these rows."""
    ok = [row for row in rows if row["status"] == "ok"]
    if not ok:
        return []
    last = ok[-1]
    peak, budget = last["chunked_peak_mib"], 2 * last["input_mib"]
    lines = [
        f"peak memory <= 2 inputs ({budget:.0f} MiB) at N={last['tokens']}: {peak:.0f} MiB -> "
        f"{'met' if peak <= budget else 'NOT met'}",
        f"speedup vs SDPA >= 10x at N={last['tokens']}: {last['chunked_speedup_vs_sdpa']:.1f}x -> "
        f"{'met' if last['chunked_speedup_vs_sdpa'] >= 10 else 'NOT met'}",
    ]
    if "chunked_resident_mib" in last:
        resident = last["chunked_resident_mib"]
        lines.append(
            f"resident rise <= 2 inputs ({budget:.0f} MiB) at N={last['tokens']}: {resident:.0f} MiB -> "
            f"{'met' if resident <= budget else 'NOT met'}"
        )
    if last["chunked_growth"] is not None:
        growth = last["chunked_growth"]
        lines.append(
            f"time growth {ok[-2]['tokens']} -> {last['tokens']} <= 5x: {growth:.2f}x -> "
            f"{'met' if growth <= 5 else 'NOT met'}"
        )
    return lines


def add_call_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of one attention call and its timing, shared by the attention benchmarks."""
    parser.add_argument("--heads", type=int, default=24)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rounds", type=int, default=3, help="timing rounds (each times every path twice)")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads for torch (0 = torch's default)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384], help="sequence lengths (square grids)")
    add_call_arguments(parser)
    parser.add_argument(
        "--chunk-sweep", type=int, nargs="*", default=[], help="chunk sizes to sweep at the largest N (chunked path)"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    load_before = os.getloadavg()
    print(header_line())
    print(
        f"T5 attention torch paths vs SDPA | B=1, {args.heads} heads x {args.head_dim}, {args.dtype}, image grid, "
        f"no text, {torch.get_num_threads()} threads, chunk {DEFAULT_CHUNK_TOKENS} tokens, "
        f"load average {load_before[0]:.2f}"
    )
    print(
        f"{'N':>6} {'sdpa ms':>9} {'ref ms':>9} {'chunk ms':>9} {'ref':>8} {'chunked':>8} "
        f"{'sdpa x':>6} {'ref x':>6} {'chk x':>6} {'sdpa MiB':>7} {'ref MiB':>7} {'chk MiB':>7} "
        f"{'sdpa RSS':>7} {'chk RSS':>7}"
    )
    rows: list[dict] = []
    for n in args.tokens:
        previous = rows[-1] if rows and rows[-1]["status"] == "ok" else None
        rows.append(measure(n, args, previous))
        print_row(rows[-1])
    print(
        f"'ref' / 'chunked': {SPEEDUP_VS_SOFTMAX}, softmax = SDPA (> 1: T5 is faster). 'x' columns: time growth "
        "from the previous N (4x tokens: linear = 4, quadratic = 16). MiB: peak above inputs and output. "
        "RSS: rise of the peak resident set above a process holding the same inputs and output (CPU)."
    )
    for line in goals(rows):
        print("goal:", line)
    sweep: list[dict] = []
    if args.chunk_sweep:
        print(f"{'N':>6} {'chunk':>7} {'chunk ms':>10} {'peak MiB':>9}")
        sweep = sweep_chunks(max(args.tokens), args.chunk_sweep, args)
    load_after = os.getloadavg()
    print(f"load average (1 min) before {load_before[0]:.2f}, after {load_after[0]:.2f}")
    meta = {
        "heads": args.heads,
        "head_dim": args.head_dim,
        "dtype": args.dtype,
        "batch": 1,
        "threads": torch.get_num_threads(),
        "chunk_tokens": DEFAULT_CHUNK_TOKENS,
        "load_average_before": load_before,
        "load_average_after": load_after,
        "goals": goals(rows),
        "chunk_sweep": sweep,
    }
    print(f"wrote {write_json(f'attention_{args.device}', rows, meta)}")


if __name__ == "__main__":
    main()

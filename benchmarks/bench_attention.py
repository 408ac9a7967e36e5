"""One attention call per path against PyTorch SDPA: time, speedup, growth with N, and memory.

    python -m benchmarks.bench_attention                                 # 64x64 and 128x128, sdpa,ref,chunked
    python -m benchmarks.bench_attention --grids 32x32 64x64 --chunk-sweep 512 1024 2048
    python -m benchmarks.bench_attention --paths sdpa,t5,hybrid,hybrid_na --text 154 --backward --suffix _hybrid
    python -m benchmarks.bench_attention --paths sdpa,t5,triton --backward --batch 2 --text 333 --suffix _kernels

Paths (`--paths`, `benchmarks.cases.PATHS`): `sdpa`, `ref`, `chunked`, `t5`, `hybrid`, `hybrid_na` and
`triton`, all on one `benchmarks.cases.AttentionCase`: seeded q, k, v for a square or `HxW` image grid
with `--text` text tokens first, and `T5Attention`'s initial parameters. On CUDA every SDPA call is
pinned to FlashAttention. Each grid is checked first (`AttentionCase.check`: T5 over all tokens
against the fp32 reference, a hybrid's text rows against SDPA's); a failure makes the row FAIL and
nothing is timed. Without a usable Triton the `triton` path is left out and the row says why
(TRITON_INTERPRET=1 runs the kernels slowly on CPU).

Time: after one warm-up call of each path, `--rounds` rounds each time every path in turn (the median
of two calls, `benchmarks.timing.time_in_turn`), and a path's time is the median over the rounds
(20 / 80 % quantiles beside it); the forward without autograd, and with `--backward` also forward +
backward. On a shared machine the paths so see the same load; the load average is recorded.
Speedup = SDPA time / path time (> 1: T5 is faster); growth = time at this grid / time at the
previous one.

Peak memory: the most memory one forward holds at once above its inputs and output (MiB), as
`testing.peak_memory.peak_memory_mib` measures it: CUDA's allocator peak, or on CPU the profiler's
record of every allocation, which is not disturbed by load. Resident memory (CPU, `--resident`
paths): the rise of the process's peak resident set (`VmHWM`) that one forward causes, measured in
two child processes that build the same inputs: one runs the call, the other only fills an output of
the same size. Unlike the peak above, it includes what the allocator keeps or fragments, thread
pools and the code the call loads. `VmHWM`, not `ru_maxrss`: Linux carries `ru_maxrss` across a
spawned child's `exec`, so both children would report this process's resident set at the fork.

With `triton`, the kernels' bandwidth: their minimum HBM traffic (k read twice, q and v once, the output
written once) over their time, against the GPU's peak (`--peak-gbs`, else a table of GPUs) and a
measured device copy. `--chunk-sweep` times the `chunked` path at the largest grid for each chunk size
(the choice of `t5core.ttt_chunked.DEFAULT_CHUNK_TOKENS`). Goals are checked at the largest grid.
Writes `benchmarks/results/attention_<device><suffix>.json`.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
from typing import Any

import torch

from benchmarks.cases import PATHS, AttentionCase, add_case_arguments, goal, grid_of, softmax_backend
from benchmarks.step_probes import peak_resident_mib
from benchmarks.timing import (
    fmt_ms,
    fmt_x,
    header_line,
    markdown_table,
    publish,
    speedup,
    summarize,
    time_fn,
    time_in_turn,
)
from t5core.ttt_chunked import DEFAULT_CHUNK_TOKENS
from testing.peak_memory import peak_memory_mib

TITLE = "T5 attention paths vs SDPA"
PASSES = {"fwd": "forward", "fwdbwd": "forward + backward"}
MEMORY = ("peak", "resident")
# HBM peak (GB/s, vendor specs) by device-name fragment; --peak-gbs overrides.
PEAK_GBS = {"H200": 4800.0, "H100 SXM": 3350.0, "H100 PCIe": 2000.0, "H100": 3350.0, "A100-SXM4-80GB": 2039.0}
GOALS = (
    # (path, quantity, op, bound), at the largest grid: `speedup` vs SDPA, `fraction` = time / SDPA time,
    # `growth` over the previous grid, memory in inputs (the bytes of q)
    ("chunked", "speedup", ">=", 10),
    ("chunked", "growth", "<=", 5),
    ("chunked", "peak_inputs", "<=", 2),
    ("chunked", "resident_inputs", "<=", 2),
    ("hybrid", "fraction", "<=", 0.06),
    ("hybrid", "growth", "<=", 5),
)


def _resident_child(path: str | None, grid: tuple[int, int], args: argparse.Namespace, conn) -> None:
    """In a fresh process: build the case, then run the `path` call, or for `path=None` only fill an
    output of its size; send the peak resident set in MiB."""
    if args.threads:
        torch.set_num_threads(args.threads)
    case = AttentionCase(grid, args)
    out = case.forward(path)() if path else torch.ones_like(case.q)
    conn.send(peak_resident_mib())
    del out


def resident_rise_mib(path: str, grid: tuple[int, int], args: argparse.Namespace) -> float:
    """How far one `path` call raises the peak resident set of a process holding its inputs and output,
    in MiB (module docstring). CPU only."""
    context = multiprocessing.get_context("spawn")
    peaks = []
    for child_path in (path, None):
        receive, send = context.Pipe(duplex=False)
        child = context.Process(target=_resident_child, args=(child_path, grid, args, send))
        child.start()
        peak = receive.recv()
        child.join()
        if child.exitcode != 0:
            raise RuntimeError(f"the resident-memory child for {child_path or 'the baseline'} exited {child.exitcode}.")
        peaks.append(peak)
    return peaks[0] - peaks[1]


def _times(fns: dict, rounds: int) -> dict[str, dict[str, float]]:
    return {path: summarize(times) for path, times in time_in_turn(fns, rounds=rounds, calls=2).items()}


def measure(grid: tuple[int, int], args: argparse.Namespace) -> dict[str, Any]:
    """One row: check every path, then time it (each pass) and measure its memory."""
    case = AttentionCase(grid, args)
    row: dict[str, Any] = {"grid": f"{grid[0]}x{grid[1]}", "image_tokens": grid[0] * grid[1], "status": "ok"}
    paths = list(args.paths)
    if "triton" in paths:
        import t5kernels

        reason = t5kernels.unsupported_reason(case.q, variant=case.module.variant)
        if reason is not None:
            paths.remove("triton")
            row["skipped"] = {"triton": reason}
    row["errors"] = {}
    for path in paths:
        checked = case.check(path)
        if checked is not None:
            row["errors"][path], bound = checked
            if not checked[0] <= bound:
                row["status"] = f"FAIL: `{path}` relative RMS error {checked[0]:.1e} > {bound:.0e}"
                return row
    row["input_mib"] = case.q.numel() * case.q.element_size() / 2**20
    row["ms"] = {"fwd": _times({p: case.forward(p) for p in paths}, args.rounds)}
    if args.backward:
        row["ms"]["fwdbwd"] = _times({p: case.forward_backward(p) for p in paths}, args.rounds)
    row["peak_mib"] = {path: peak_memory_mib(case.forward(path), args.device) for path in paths}
    if args.device == "cpu":
        row["resident_mib"] = {p: resident_rise_mib(p, grid, args) for p in paths if p in args.resident}
    if "triton" in paths:
        row["triton_bytes"] = 5 * case.q.numel() * case.q.element_size()
    return row


def sweep_chunks(grid: tuple[int, int], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Time and peak memory of the chunked path at one grid for each chunk size of `--chunk-sweep`."""
    case = AttentionCase(grid, args)
    fns = {size: case.forward("chunked", chunk_tokens=size) for size in args.chunk_sweep}
    return [
        {"tokens": case.tokens, "chunk_tokens": size, **timing, "peak_mib": peak_memory_mib(fns[size], args.device)}
        for size, timing in _times(fns, args.rounds).items()
    ]


def _quantities(row: dict[str, Any], previous: dict[str, Any] | None, kind: str, path: str) -> dict[str, float]:
    """The quantities `GOALS` and the table use, of one path in one pass of a row."""
    ms = row["ms"][kind]
    values = {"speedup": speedup(ms["sdpa"]["median_ms"], ms[path]["median_ms"])} if "sdpa" in ms else {}
    values["fraction"] = 1 / values["speedup"] if values else None
    if previous is not None and path in previous["ms"].get(kind, {}):
        values["growth"] = ms[path]["median_ms"] / previous["ms"][kind][path]["median_ms"]
    for memory in MEMORY:
        if path in row.get(f"{memory}_mib", {}):
            values[f"{memory}_inputs"] = row[f"{memory}_mib"][path] / row["input_mib"]
    return values


def goals(rows: list[dict[str, Any]]) -> list[str]:
    """`GOALS` for the paths this run timed, at its largest grid."""
    ok = [row for row in rows if row["status"] == "ok"]
    if not ok:
        return []
    last, previous = ok[-1], (ok[-2] if len(ok) > 1 else None)
    lines = []
    for kind in last["ms"]:
        for path, quantity, op, bound in GOALS:
            value = _quantities(last, previous, kind, path).get(quantity) if path in last["ms"][kind] else None
            if value is not None and (kind == "fwd" or not quantity.endswith("inputs")):
                lines.append(goal(f"{PASSES[kind]}, `{path}` {quantity} at {last['grid']}", value, op, bound))
    return lines


def table(result: dict[str, Any]) -> list[str]:
    """The markdown table of one run (also of results written before `paths` and `text_tokens` were
    recorded: these are the paths of the first timed row, and no text)."""
    meta, rows = result["meta"], result["rows"]
    ok = [row for row in rows if row["status"] == "ok"]
    paths = [path for path in meta["paths"] if ok and path in ok[0]["ms"]["fwd"]]
    t5 = [path for path in paths if path != "sdpa"]
    text = meta.get("text_tokens", 0)
    intro = [
        f"One attention call per path on the same inputs: batch {meta['batch']}, {meta['heads']} heads x "
        f"{meta['head_dim']}, {meta['dtype']}, an image grid"
        + (f" plus {text} text tokens first" if text else " and no text")
        + f", threads: {meta['threads']}. Paths: "
        + "; ".join(f"`{path}`: {PATHS[path]}" for path in paths)
        + ". Growth is the time over the previous row's (4x the tokens: linear = 4x, quadratic = 16x); peak is "
        "the memory one forward holds above its inputs; resident is how far one forward raises the peak "
        "resident set of a process holding the same inputs and output (`VmHWM` of two child processes)."
    ]
    if "copy_gbs" in meta:
        peak = f"{meta['peak_gbs']:.0f} GB/s" if meta.get("peak_gbs") else "unknown"
        intro.append(f"Bandwidth: HBM peak {peak}, measured device copy {meta['copy_gbs']:.0f} GB/s.")
    memory = {
        kind: [p for p in paths if any(p in row.get(f"{kind}_mib", {}) for row in ok)] for kind in ("peak", "resident")
    }
    header = ["grid", "N", "pass", *(f"`{p}` ms" for p in paths), *(f"speedup `{p}`" for p in t5)]
    header += [f"`{p}` growth" for p in paths] + [f"`{p}` {kind} MiB" for kind, of in memory.items() for p in of]
    header += ["Triton GB/s"] if any("triton_bytes" in row for row in ok) else []
    lines, previous = [], None
    for row in rows:
        head = [row["grid"], row["image_tokens"] + text]
        if row["status"] != "ok":
            lines.append([*head, row["status"]])
            continue
        for kind, ms in row["ms"].items():
            values = {path: _quantities(row, previous, kind, path) for path in paths}
            cells = [*head, PASSES[kind], *(fmt_ms(ms[p]["median_ms"]) for p in paths)]
            cells += [fmt_x(values[p]["speedup"]) for p in t5]
            cells += [fmt_x(values[p]["growth"]) if "growth" in values[p] else "-" for p in paths]
            for kind_of_memory, of in memory.items():
                found = row.get(f"{kind_of_memory}_mib", {})
                cells += [f"{found[p]:.0f}" if kind == "fwd" and p in found else "-" for p in of]
            if "triton_bytes" in row:
                cells.append(f"{row['triton_bytes'] / ms['triton']['median_ms'] / 1e6:.0f}")
            lines.append(cells)
        previous = row
    skipped = sorted({f"`{path}` not run: {why}" for row in rows for path, why in row.get("skipped", {}).items()})
    notes = [f"* {line}" for line in skipped] + [f"* goal: {line}" for line in meta.get("goals", [])]
    return [*intro, "", *markdown_table(header, lines), *([""] + notes if notes else []), *_chunk_sweep(meta)]


def _chunk_sweep(meta: dict[str, Any]) -> list[str]:
    sweep = meta.get("chunk_sweep") or []
    if not sweep:
        return []
    intro = (
        f"Chunk sizes of the `chunked` path at N={sweep[0]['tokens']} (`--chunk-sweep`, timed in turn as above; "
        f"the default, `t5core.ttt_chunked.DEFAULT_CHUNK_TOKENS`, is {meta['chunk_tokens']}):"
    )
    rows = [
        [row["chunk_tokens"], fmt_ms(row["median_ms"]), f"{fmt_ms(row['p20_ms'])}-{fmt_ms(row['p80_ms'])}",
         f"{row['peak_mib']:.0f}"]
        for row in sweep
    ]  # fmt: skip
    return ["", intro, "", *markdown_table(["chunk tokens", "ms", "p20-p80 ms", "peak MiB"], rows)]


def copy_gbs(device: str) -> float:
    """Achieved device-to-device copy bandwidth (read + write), a practical ceiling."""
    src = torch.empty(256 * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() / time_fn(lambda: dst.copy_(src), warmup=3, reps=10)["median_ms"] / 1e6


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--paths", default="sdpa,ref,chunked", help=f"comma-separated, of: {', '.join(PATHS)}")
    parser.add_argument("--grids", type=grid_of, nargs="+", default=[(64, 64), (128, 128)],
                        help="image grids: HxW or a square number of tokens")  # fmt: skip
    add_case_arguments(parser, heads=24, text=0, batch=1)
    parser.add_argument("--backend", default="torch", choices=["auto", "torch", "triton"], help="of `t5`, `hybrid*`")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads for torch (0 = torch's default)")
    parser.add_argument("--backward", action="store_true", help="also time forward + backward")
    parser.add_argument("--rounds", type=int, default=3, help="timing rounds (each times every path twice)")
    parser.add_argument("--resident", default="sdpa,chunked", help="paths whose resident rise is measured (CPU)")
    parser.add_argument("--chunk-sweep", type=int, nargs="*", default=[], help="chunk sizes at the largest grid")
    parser.add_argument("--peak-gbs", type=float, help="HBM peak in GB/s (default: from a table of GPUs)")
    parser.add_argument("--suffix", default="", help="appended to the JSON's name: attention_<device><suffix>")
    args = parser.parse_args(argv)
    args.paths = args.paths.split(",")
    args.resident = args.resident.split(",")
    unknown = sorted(set(args.paths) - set(PATHS))
    if unknown or "sdpa" not in args.paths:
        parser.error(f"--paths: give sdpa (the baseline) and others of {list(PATHS)}; unknown: {unknown}.")
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    print(header_line())
    with softmax_backend(args.device):
        rows = [measure(grid, args) for grid in args.grids]
        sweep = sweep_chunks(max(args.grids, key=lambda g: g[0] * g[1]), args) if args.chunk_sweep else []
    meta = {
        "paths": args.paths,
        **{key: getattr(args, key) for key in ("batch", "heads", "head_dim", "dtype", "backend")},
        "text_tokens": args.text,
        "threads": torch.get_num_threads(),
        "chunk_tokens": DEFAULT_CHUNK_TOKENS,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "goals": goals(rows),
        "chunk_sweep": sweep,
    }
    if "triton" in args.paths:
        gpu = torch.cuda.get_device_name() if args.device == "cuda" else ""
        peak = args.peak_gbs or next((gbs for part, gbs in PEAK_GBS.items() if gpu and part in gpu), None)
        meta.update(peak_gbs=peak, copy_gbs=copy_gbs(args.device))
    name = f"attention_{args.device}{args.suffix}"
    publish(name, rows, meta, table=table, directory=args.results_dir)


if __name__ == "__main__":
    main()

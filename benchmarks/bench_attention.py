"""One attention call per path against PyTorch SDPA: time, speedup, growth with N, and memory.

    python -m benchmarks.bench_attention                                 # 64x64 and 128x128, sdpa,ref,chunked
    python -m benchmarks.bench_attention --grids 32x32 64x64 --chunk-sweep 512 1024 2048
    python -m benchmarks.bench_attention --paths sdpa,t5,t5_image,text_rows,merge,hybrid,hybrid_na --text 154 \
        --suffix _hybrid
    python -m benchmarks.bench_attention --paths sdpa,t5,triton --backward --batch 2 --text 333 --suffix _kernels \
        --model-step 1024 2048                                           # the kernels: benchmarks/gpu_check.sh

Every path of `--paths` (`benchmarks.cases.PATHS`) runs on one `benchmarks.cases.AttentionCase` per
grid (`HxW` or a square number of image tokens, `--text` text tokens first); on CUDA the `sdpa` baseline
(and the softmax model of `--model-step`) is pinned to FlashAttention. Each grid is checked first
(`AttentionCase.check`); a failure makes the row FAIL and nothing is timed. Without a usable Triton the
`triton` path is left out and the row says why (TRITON_INTERPRET=1 runs the kernels slowly on CPU).

Time: after one warm-up call of each path, `--rounds` rounds each time every path in turn (the median
of two calls, `benchmarks.timing.time_paths`), so on a shared machine the paths see the same load;
a path's time is the median over the rounds, of the forward without autograd and with `--backward`
also of forward + backward. Speedup = SDPA time / path time; growth = time over the previous grid's.

Memory: the peak of one forward above its inputs and output (`testing.peak_memory.peak_memory_mib`,
not disturbed by load) and, on CPU for the `--resident` paths, how far one forward raises the peak
resident set (`VmHWM`) of a child process that holds the same inputs, against a child that only fills
an output of the same size (`benchmarks.step_probes.peak_resident_mib`). It includes what the
allocator keeps, thread pools and loaded code.

With `triton`, the kernels' bandwidth: their minimum HBM traffic (k read twice, q and v once, the output
written once) over their time, beside the GPU's peak (`--peak-gbs`, else a table of GPUs) and a
measured device copy. `--chunk-sweep` times the `chunked` path at the largest grid for each chunk size
(the choice of `t5core.ttt_chunked.DEFAULT_CHUNK_TOKENS`). `GOALS` are checked at the largest grid.

`--model-step RES ...` also times the whole transformer at those resolutions: a randomly initialised SD3.5
Medium `SD3Transformer2DModel` (bf16 on CUDA; on CPU a 2-block cut in fp32), one no-grad forward at
`--batch` with `--text` tokens, softmax against the model converted with `paper` and with `all` on the
torch backend and, where the kernels can run, the Triton one, whose output must match the torch
backend's (`MODEL_RATIO`) before its row counts. Writes `benchmarks/results/attention_<device><suffix>.json`.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
from typing import Any

import torch

import t5kernels
from benchmarks import cases
from benchmarks.cases import PATHS, AttentionCase, add_case_arguments, goal, grid_of, sd3_inputs, softmax_backend
from benchmarks.step_probes import peak_resident_mib
from benchmarks.timing import fmt_ms, fmt_x, header_line, markdown_table, publish, speedup, time_fn, time_paths
from t5core.ttt_chunked import DEFAULT_CHUNK_TOKENS
from testing.models import sd35_medium_config
from testing.peak_memory import peak_memory_mib
from testing.tolerances import relative_rms

TITLE = "T5 attention paths vs SDPA"
PASSES = {"fwd": "forward", "fwdbwd": "forward + backward"}
MEMORY = ("peak", "resident")
# HBM peak (GB/s, vendor specs) by device-name fragment; --peak-gbs overrides.
PEAK_GBS = {"H200": 4800.0, "H100 SXM": 3350.0, "H100 PCIe": 2000.0, "H100": 3350.0, "A100-SXM4-80GB": 2039.0}
MODEL_SPECS = ("paper", "all")
HYBRID_PARTS = ("t5_image", *cases.HYBRID_ROW_PARTS)
"""The paths that time the hybrid's parts alone."""
# Through 24 blocks in bf16 the two backends' rounding differences compound; this only catches
# garbage (a wrong kernel gives O(1)).
MODEL_RATIO = 5e-2
GOALS = (
    # (path, quantity, op, bound), at the largest grid: `speedup` vs SDPA, `fraction` = time / SDPA time,
    # `growth` over the previous grid, memory in inputs (the bytes of q), `over_parts` as `_quantities` says
    ("chunked", "speedup", ">=", 10),
    ("chunked", "growth", "<=", 5),
    ("chunked", "peak_inputs", "<=", 2),
    ("chunked", "resident_inputs", "<=", 2),
    ("hybrid", "fraction", "<=", 0.06),
    ("hybrid", "growth", "<=", 4.5),
    ("hybrid", "over_parts", "<=", 1.25),
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


def measure(grid: tuple[int, int], args: argparse.Namespace) -> dict[str, Any]:
    """One row: check every path, then time it (each pass) and measure its memory."""
    case = AttentionCase(grid, args)
    row: dict[str, Any] = {"grid": f"{grid[0]}x{grid[1]}", "image_tokens": grid[0] * grid[1], "status": "ok"}
    # the text's share of SDPA's FLOPs: T (N + M) of the N^2 query-key pairs
    row["text_share"] = args.text * (case.tokens + row["image_tokens"]) / case.tokens**2
    paths = list(args.paths)
    if "triton" in paths:
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
    row["ms"] = {"fwd": time_paths({p: case.forward(p) for p in paths}, rounds=args.rounds, calls=2)}
    if args.backward:
        row["ms"]["fwdbwd"] = time_paths({p: case.forward_backward(p) for p in paths}, rounds=args.rounds, calls=2)
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
        for size, timing in time_paths(fns, rounds=args.rounds, calls=2).items()
    ]


def _quantities(row: dict[str, Any], previous: dict[str, Any] | None, kind: str, path: str) -> dict[str, float]:
    """The quantities `GOALS` and the table use, of one path in one pass of a row. `over_parts` is the hybrid's
    time over the sum of its parts: `t5_image` timed alone, and the text's softmax FLOPs at SDPA's rate in the
    same row (SDPA's time x `text_share`); `over_timed_parts` over `HYBRID_PARTS` each timed alone."""
    ms = row["ms"][kind]
    ratio = speedup(ms["sdpa"]["median_ms"], ms[path]["median_ms"])
    values = {"speedup": ratio, "fraction": 1 / ratio}
    if path == "hybrid" and "t5_image" in ms:
        parts = ms["t5_image"]["median_ms"] + ms["sdpa"]["median_ms"] * row["text_share"]
        values["over_parts"] = ms[path]["median_ms"] / parts
    if path == "hybrid" and set(HYBRID_PARTS) <= ms.keys():
        values["over_timed_parts"] = ms[path]["median_ms"] / sum(ms[part]["median_ms"] for part in HYBRID_PARTS)
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
    """The markdown table of one run: per grid and pass, each path's time, speedup vs SDPA, growth and
    memory; the chunk sweep and the whole-model step below it."""
    meta, rows = result["meta"], result["rows"]
    ok = [row for row in rows if row["status"] == "ok"]
    paths = [path for path in meta["paths"] if ok and path in ok[0]["ms"]["fwd"]]
    t5 = [path for path in paths if path != "sdpa"]
    text = meta["text_tokens"]
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
    parts = "hybrid" in paths and "t5_image" in paths
    timed_parts = "hybrid" in paths and set(HYBRID_PARTS) <= set(paths)
    if parts:
        intro.append(
            "`hybrid` / parts: the hybrid's time over the sum of its parts, `t5_image` and the text's softmax "
            "FLOPs (text queries over all keys, image queries over the text keys) at SDPA's rate in the same row"
            + ("; / timed parts: over `t5_image` + `text_rows` + `merge`, each timed alone." if timed_parts else ".")
        )
    if "copy_gbs" in meta:
        peak = f"{meta['peak_gbs']:.0f} GB/s" if meta.get("peak_gbs") else "unknown"
        intro.append(f"Bandwidth: HBM peak {peak}, measured device copy {meta['copy_gbs']:.0f} GB/s.")
    memory = {kind: [p for p in paths if any(p in row.get(f"{kind}_mib", {}) for row in ok)] for kind in MEMORY}
    header = ["grid", "N", "pass", *(f"`{p}` ms" for p in paths), *(f"speedup `{p}`" for p in t5)]
    header += [f"`{p}` growth" for p in paths] + [f"`{p}` {kind} MiB" for kind, of in memory.items() for p in of]
    header += ["Triton GB/s"] if any("triton_bytes" in row for row in ok) else []
    header += ["`hybrid` / parts"] if parts else []
    header += ["`hybrid` / timed parts"] if timed_parts else []
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
            if parts:
                cells.append(fmt_x(values["hybrid"]["over_parts"]))
            if timed_parts:
                cells.append(fmt_x(values["hybrid"]["over_timed_parts"]))
            lines.append(cells)
        previous = row
    skipped = sorted({f"`{path}` not run: {why}" for row in rows for path, why in row.get("skipped", {}).items()})
    notes = [f"* {line}" for line in skipped] + [f"* goal: {line}" for line in meta.get("goals", [])]
    tail = [*_chunk_sweep(meta), *_model_step(meta)]
    return [*intro, "", *markdown_table(header, lines), *([""] + notes if notes else []), *tail]


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


def model_config(device: str) -> dict:
    """SD3.5 Medium on CUDA; on CPU a 2-block cut of it (same head dim and text width)."""
    if device == "cuda":
        return sd35_medium_config()
    reduced = dict(num_layers=2, num_attention_heads=2, caption_projection_dim=128, dual_attention_layers=(0,))
    return {**sd35_medium_config(), **reduced, "pos_embed_max_size": 96}


def model_step_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Whole-transformer no-grad step: softmax vs `paper` / `all` with each available backend."""
    from diffusers import SD3Transformer2DModel

    from t5core.hosts.diffusers import linearize

    config = model_config(args.device)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(args.device):
        model = SD3Transformer2DModel(**config).to(dtype).eval()
    probe = torch.empty(1, 1, config["num_attention_heads"], config["attention_head_dim"], device=args.device)
    reason = t5kernels.unsupported_reason(probe.to(dtype), variant="swiglu")
    backends = ["torch"] + (["triton"] if reason is None else [])
    rows = []
    for resolution in args.model_step:
        inputs = sd3_inputs(config, batch=args.batch, resolution=resolution, text=args.text)
        inputs = {name: t.to(args.device, dtype) for name, t in inputs.items()}

        def step(inputs: dict = inputs) -> torch.Tensor:
            with torch.no_grad():
                return model(**inputs, return_dict=False)[0]

        tokens = (resolution // 8 // config["patch_size"]) ** 2 + args.text
        row: dict[str, Any] = {"resolution": resolution, "tokens": tokens, "status": "ok"}
        row["softmax_median_ms"] = time_fn(step, warmup=1, reps=args.rounds)["median_ms"]
        if reason is not None:
            row["triton_skipped"] = reason
        for spec in MODEL_SPECS:
            outputs = {}
            for backend in backends:
                torch.manual_seed(2)
                handle = linearize(model, layers=spec, backend=backend)
                try:
                    outputs[backend] = step().float()
                    row[f"{spec}_{backend}_median_ms"] = time_fn(step, warmup=1, reps=args.rounds)["median_ms"]
                finally:
                    handle.remove()
            if "triton" in outputs:
                error = relative_rms(outputs["torch"], outputs["triton"])
                row[f"{spec}_triton_rel_err"] = error
                if not error <= MODEL_RATIO:
                    row["status"] = f"FAIL: {spec} triton vs torch relative RMS error {error:.1e} > {MODEL_RATIO:.0e}"
        rows.append(row)
    return rows


def _model_step(meta: dict[str, Any]) -> list[str]:
    rows = meta.get("model_step") or []
    if not rows:
        return []
    model = "a 2-block cut of SD3.5 Medium" if meta["device"].startswith("cpu") else "SD3.5 Medium"
    intro = (
        f"The whole transformer step (`--model-step`): one no-grad step of {model} (random weights), batch "
        f"{meta['batch']}, {meta['text_tokens']} text tokens; softmax is SDPA, the T5 columns convert the `paper` or "
        "`all` modules on the named backend; ms (speedup)."
    )
    columns = [f"{spec}_{backend}" for spec in MODEL_SPECS for backend in ("torch", "triton")]
    cells = []
    for row in rows:
        base = row["softmax_median_ms"]
        timed = [row.get(f"{column}_median_ms") for column in columns]
        speeds = [f"{fmt_ms(ms)} ({fmt_x(speedup(base, ms))})" if ms is not None else "n/a" for ms in timed]
        cells.append([row["resolution"], row["tokens"], fmt_ms(base), *speeds, row["status"]])
    header = ["resolution", "N", "softmax ms", *(f"`{c.replace('_', '` ')}" for c in columns), "check"]
    return ["", intro, "", *markdown_table(header, cells)]


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
    parser.add_argument("--model-step", type=int, nargs="*", default=[], help="also time the whole model at these px")
    parser.add_argument("--peak-gbs", type=float, help="HBM peak in GB/s (default: from a table of GPUs)")
    parser.add_argument("--suffix", default="", help="appended to the JSON's name: attention_<device><suffix>")
    args = parser.parse_args(argv)
    args.paths = args.paths.split(",")
    args.resident = args.resident.split(",")
    unknown = sorted(set(args.paths) - set(PATHS))
    if unknown or "sdpa" not in args.paths:
        parser.error(f"--paths: give sdpa (the baseline) and others of {list(PATHS)}; unknown: {unknown}.")
    if set(cases.HYBRID_ROW_PARTS) & set(args.paths) and (args.backward or not args.text):
        parser.error(f"--paths {' and '.join(cases.HYBRID_ROW_PARTS)}: the hybrid's parts, forward only, --text > 0.")
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    print(header_line())
    rows = [measure(grid, args) for grid in args.grids]
    sweep = sweep_chunks(max(args.grids, key=lambda g: g[0] * g[1]), args) if args.chunk_sweep else []
    # the softmax model's attention on FlashAttention, as the `sdpa` path's (`AttentionCase.call`)
    with softmax_backend(args.device):
        model_step = model_step_rows(args) if args.model_step else []
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
        "model_step": model_step,
    }
    if "triton" in args.paths:
        gpu = torch.cuda.get_device_name() if args.device == "cuda" else ""
        peak = args.peak_gbs or next((gbs for part, gbs in PEAK_GBS.items() if gpu and part in gpu), None)
        meta.update(peak_gbs=peak, copy_gbs=copy_gbs(args.device))
    publish(f"attention_{args.device}{args.suffix}", rows, meta, table=table, directory=args.results_dir)


if __name__ == "__main__":
    main()

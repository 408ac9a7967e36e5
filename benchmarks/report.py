"""Write `benchmarks/README.md` from the result files under `benchmarks/results/`; never edit it by hand.

    python -m benchmarks.report            # rewrite benchmarks/README.md
    python -m benchmarks.report --check    # exit 1 when benchmarks/README.md differs from the results

Each result file (`benchmarks/results/<name>.json`, written by `benchmarks.timing.write_json`) has one
renderer below, chosen by its name; a file without one is an error, so a new result cannot be left
out silently. Every speed ratio is recomputed from the stored times with `benchmarks.timing.speedup`,
the project's one convention: softmax time / T5 time, above 1 means T5 is faster.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from benchmarks.timing import RESULTS_DIR, SPEEDUP_VS_SOFTMAX, speedup

__all__ = ["README", "render"]

README = Path(__file__).resolve().parent / "README.md"
Result = dict[str, Any]


def _ms(value: float) -> str:
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}"


def _x(value: float) -> str:
    return f"{value:.2f}x"


def _table(header: Iterable[str], rows: Iterable[Iterable[Any]]) -> list[str]:
    header = list(header)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]


def _measured(result: Result) -> str:
    meta = result["meta"]
    return f"Measured on {meta['device']}, torch {meta['torch']}, Triton {meta['triton']}, commit {meta['commit']}."


def _attention(result: Result) -> list[str]:
    meta = result["meta"]
    intro = (
        f"One T5 attention call per torch path against PyTorch SDPA: batch {meta['batch']}, {meta['heads']} heads "
        f"x {meta['head_dim']}, {meta['dtype']}, a square image grid, no text, threads: {meta['threads']}. Growth "
        "is the time over the previous row's (4x the tokens: linear = 4x, quadratic = 16x); peak is the memory one "
        "call holds above its inputs; resident is how far one call raises the peak resident set of a process "
        "holding the same inputs and output (`VmHWM` of two child processes)."
    )
    ok = [row for row in result["rows"] if row["status"] == "ok"]
    paths = [key[: -len("_median_ms")] for key in ok[0] if key.endswith("_median_ms") and key != "sdpa_median_ms"]
    resident = [path for path in ("sdpa", *paths) if f"{path}_resident_mib" in ok[0]]
    rows = []
    for row in result["rows"]:
        if row["status"] != "ok":
            rows.append([row["tokens"], row["status"]])
            continue
        everything = ["sdpa", *paths]
        rows.append(
            [
                row["tokens"],
                *(_ms(row[f"{path}_median_ms"]) for path in everything),
                *(_x(speedup(row["sdpa_median_ms"], row[f"{path}_median_ms"])) for path in paths),
                *(f"{row[f'{path}_growth']:.2f}x" if row.get(f"{path}_growth") else "-" for path in everything),
                *(f"{row[f'{path}_peak_mib']:.0f}" for path in everything),
                *(f"{row[f'{path}_resident_mib']:.0f}" for path in resident),
            ]
        )
    names = ["SDPA", *(f"T5 `{path}`" for path in paths)]
    header = [
        "N",
        *(f"{name} ms" for name in names),
        *(f"speedup `{path}`" for path in paths),
        *(f"{name} growth" for name in names),
        *(f"{name} peak MiB" for name in names),
        *(f"{'SDPA' if path == 'sdpa' else f'T5 `{path}`'} resident MiB" for path in resident),
    ]
    goals = [f"* goal: {goal}" for goal in meta.get("goals", [])]
    return [intro, "", *_table(header, rows), *([""] + goals if goals else []), *_chunk_sweep(meta)]


def _chunk_sweep(meta: dict[str, Any]) -> list[str]:
    """The `--chunk-sweep` rows: the chunked path's time and peak memory per chunk size at one N."""
    sweep = meta.get("chunk_sweep") or []
    if not sweep:
        return []
    intro = (
        f"Chunk sizes of the `chunked` path at N={sweep[0]['tokens']} (`--chunk-sweep`, timed in turn as above; "
        f"the default, `t5core.ttt_chunked.DEFAULT_CHUNK_TOKENS`, is {meta['chunk_tokens']}):"
    )
    rows = [
        [
            row["chunk_tokens"],
            _ms(row["median_ms"]),
            f"{_ms(row['p20_ms'])}-{_ms(row['p80_ms'])}",
            f"{row['peak_mib']:.0f}",
        ]
        for row in sweep
    ]
    return ["", intro, "", *_table(["chunk tokens", "ms", "p20-p80 ms", "peak MiB"], rows)]


def _hybrid_attention(result: Result) -> list[str]:
    meta = result["meta"]
    intro = (
        f"One joint attention call: batch {meta['batch']}, {meta['heads']} heads x {meta['head_dim']}, "
        f"{meta['dtype']}, a square image grid plus {result['rows'][0]['text_tokens']} text tokens, threads: "
        f"{meta['threads']}. `T5 ttt`: T5 over all tokens (the paper's joint mode); `hybrid`: exact softmax "
        "wherever text takes part, T5 between image tokens; `+ NA`: hybrid with the 5x5 neighbourhood softmax "
        "blended into the image rows. Fraction = T5 time / SDPA time; growth over the previous row's image tokens."
    )
    # result files without the neighbourhood blend have no `hybrid_na` columns
    paths = ("t5", "hybrid", "hybrid_na") if "fwd_hybrid_na_ms" in result["rows"][0] else ("t5", "hybrid")
    rows = []
    for row in result["rows"]:
        if row["status"] != "ok":
            rows.append([row["image_tokens"], row["status"]])
            continue
        for kind in ("fwd", "fwdbwd"):
            if f"{kind}_sdpa_ms" not in row:
                continue
            growth = row.get(f"{kind}_hybrid_growth")
            rows.append(
                [
                    row["image_tokens"],
                    "forward" if kind == "fwd" else "forward + backward",
                    *(_ms(row[f"{kind}_{path}_ms"]) for path in ("sdpa", *paths)),
                    *(f"{row[f'{kind}_{path}_fraction_of_sdpa']:.3f}" for path in paths),
                    _x(row[f"{kind}_hybrid_speedup_vs_sdpa"]),
                    f"{growth:.2f}x" if growth else "-",
                ]
            )
    names = {"t5": "T5 ttt", "hybrid": "hybrid", "hybrid_na": "hybrid + NA"}
    header = ["image N", "pass", "SDPA ms", *(f"{names[p]} ms" for p in paths),
              *(f"{names[p]} fraction" for p in paths), "hybrid speedup", "hybrid growth"]  # fmt: skip
    goals = [f"* goal: {goal}" for goal in meta.get("goals", [])]
    return [intro, "", *_table(header, rows), *([""] + goals if goals else [])]


def _kernels(result: Result) -> list[str]:
    meta = result["meta"]
    intro = (
        f"One T5 attention call through the Triton kernels, the torch path and SDPA on the same inputs: batch "
        f"{meta['batch']}, {meta['heads']} heads x {meta['head_dim']}, {meta['text']} text tokens, {meta['dtype']}. "
        "Triton vs torch is the kernels' speedup vs the torch path (torch time / Triton time)."
    )
    attention = [row for row in result["rows"] if "model" not in row]
    rows = []
    for row in attention:
        if row["status"] != "ok":
            rows.append([row["grid"], row["tokens"], row["status"], "", "", "", "", ""])
            continue
        triton = "triton_median_ms" in row
        sdpa = row["sdpa_median_ms"]
        rows.append(
            [
                row["grid"],
                row["tokens"],
                _ms(sdpa),
                _ms(row["torch_median_ms"]),
                _ms(row["triton_median_ms"]) if triton else "n/a",
                _x(speedup(sdpa, row["torch_median_ms"])),
                _x(speedup(sdpa, row["triton_median_ms"])) if triton else "n/a",
                _x(speedup(row["torch_median_ms"], row["triton_median_ms"])) if triton else "n/a",
            ]
        )
    header = ["grid", "N", "SDPA ms", "torch ms", "Triton ms", "torch speedup", "Triton speedup", "Triton vs torch"]
    lines = [intro, "", *_table(header, rows)]
    model = [row["model"] for row in result["rows"] if "model" in row]
    if model:
        columns = [
            key[: -len("_median_ms")] for key in model[0] if key.endswith("_median_ms") and key != "softmax_median_ms"
        ]
        cells = [
            [row["resolution"], row["tokens"], _ms(row["softmax_median_ms"])]
            + [
                f"{_ms(row[c + '_median_ms'])} ({_x(speedup(row['softmax_median_ms'], row[c + '_median_ms']))})"
                for c in columns
            ]
            for row in model
        ]
        lines += ["", "Whole transformer step, no grad, ms (speedup):", ""]
        lines += _table(["resolution", "N", "softmax ms", *(f"`{c}`" for c in columns)], cells)
    return lines


def _sweep(result: Result) -> list[str]:
    meta = result["meta"]
    intro = (
        f"Launch settings of the kernels at grid {meta['grid']} + {meta['text']} text tokens, {meta['dtype']}: the "
        "defaults against the fastest setting each sweep found (speedup vs the default = default time / its time)."
    )
    rows = [
        [
            s["sweep"],
            _ms(s["default_ms"]),
            _ms(s["best_ms"]),
            _x(speedup(s["default_ms"], s["best_ms"])),
            ", ".join(f"{key} {value}" for key, value in s["best"].items()),
        ]
        if "best_ms" in s
        else [s["sweep"], s["default_status"], "", "", ""]
        for s in meta["summaries"]
    ]
    return [intro, "", *_table(["sweep", "default ms", "fastest ms", "speedup vs default", "fastest"], rows)]


def _comfy_step_whole(result: Result) -> list[str]:
    meta = result["meta"]
    model = (
        "SD3.5 Medium's architecture (24 joint blocks, `attn2` on blocks 0-12)"
        if meta["blocks"] == meta["depth"]
        else f"**only the first {meta['blocks']} of SD3.5 Medium's {meta['depth']} joint blocks**"
    )
    batch = " or ".join(
        f"{len(calls)} model call{'s' if len(calls) > 1 else ''} of batch {'/'.join(map(str, calls))}"
        for calls in meta["model_calls_per_step"]
    )
    intro = (
        f"One ComfyUI {meta['comfyui']} sampling step of {model} with random weights: one euler step, CFG "
        f"{meta['cfg']:g} (cond and uncond: {batch} per step, as ComfyUI chose), {meta['text_tokens']} text tokens, "
        f"{meta['dtype']}; softmax is SDPA, T5 runs through the T5Linearize node (`-hybrid`: hybrid joint "
        "attention, exact softmax wherever text takes part). Step *measured*: the whole step timed (median of "
        f"{meta['reps']} after {meta['warmup']} warm-up). Step *composed*: the time of everything but the joint "
        "blocks plus, for every block, the time of one block of its kind, timed inside the same model's step "
        f"({meta.get('block_reps', 1)} time{'s' if meta.get('block_reps', 1) > 1 else ''} a round); "
        f"where both ran, composed / measured checks the composition (goal: {meta['composition_goal']}). "
        "Attention share: time inside attention calls / step time. Peak: "
        f"{meta['memory_method']}; for a composed row, the peak of the step that times its blocks (every kind "
        "of block the path has, in turn)."
    )
    rows = []
    for row in result["rows"]:
        head = [f"{row['size']}x{row['size']}", f"`{row['path']}`", row["modules"], row["step"]]
        if row["status"] != "ok":
            rows.append([*head, row["status"], "", "", "", ""])
            continue
        check = row.get("composed_vs_measured")
        rows.append(
            [
                *head,
                _ms(row["median_ms"]),
                _x(speedup(_row(result, row["size"], "softmax", row["step"])["median_ms"], row["median_ms"])),
                f"{row['attention_share']:.0%}",
                f"{row['peak_mib']:.0f}",
                f"{check:.3f}" if check is not None else "-",
            ]
        )
    header = ["image", "path", "modules converted", "step", "ms", "speedup", "attention share", "peak MiB",
              "composed / measured"]  # fmt: skip
    checks = []
    for size in dict.fromkeys(row["size"] for row in result["rows"]):
        ratios = [row["composed_vs_measured"] for row in result["rows"] if row["size"] == size and
                  "composed_vs_measured" in row]  # fmt: skip
        if ratios:
            met = all(abs(ratio - 1) <= meta["composition_tolerance"] for ratio in ratios)
            rounds = [ratio for row in result["rows"] if row["size"] == size
                      for ratio in row.get("composed_vs_measured_rounds", ())]  # fmt: skip
            checks.append(
                f"* composed / measured at {size}x{size}: {min(ratios):.3f}-{max(ratios):.3f} over "
                f"{len(ratios)} paths ({'goal met' if met else 'goal NOT met: the composed rows are not validated'})"
                + (f"; round by round {min(rounds):.3f}-{max(rounds):.3f}" if rounds else "")
            )
    if "recomposed" in meta:
        checks.append(f"* {meta['recomposed']}")
    return [intro, "", *_table(header, rows), *([""] + checks if checks else [])]


def _row(result: Result, size: int, path: str, step: str) -> dict[str, Any]:
    """The row of `result` for one image size, path and kind of step."""
    return next(r for r in result["rows"] if (r["size"], r["path"], r["step"]) == (size, path, step))


def _toy_speed(result: Result) -> list[str]:
    meta = result["meta"]
    intro = (
        f"Sampling the built-in toy ({meta['steps']} Euler steps with CFG, batch {meta['batch']}): the softmax "
        f"teacher against its T5 conversion ({len(meta['layers'])} modules), timed in turn over "
        f"{meta['rounds']} rounds; times are medians over the rounds, the speedup is the median of the "
        "rounds' own ratios (20-80 % of them in brackets)."
    )
    rows = [
        [f"{row['size']} px", row["image_tokens"], row.get("status", "FAIL")]
        if "t5" not in row
        else [
            f"{row['size']} px",
            row["image_tokens"],
            _ms(row["softmax"]["median_ms"]),
            _ms(row["t5"]["median_ms"]),
            f"{_x(row['speedup_vs_softmax'])} ({row['speedup_p20']:.2f}-{row['speedup_p80']:.2f})",
        ]
        for row in result["rows"]
    ]
    return [intro, "", *_table(["image", "image tokens", "softmax ms", "T5 ms", "speedup"], rows)]


def _throughput(result: Result) -> list[str]:
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
            rows.append([row["attention"].upper(), row["procs"], mode, "FAIL", "", ""])
            continue
        vs_softmax = speedup(ms[("sdpa", *key[1:])], ms[key])
        vs_one = speedup(ms[(row["attention"], 1, "ddp")], ms[key])
        rows.append([row["attention"].upper(), row["procs"], mode, f"{ms[key]:.1f}", _x(vs_softmax), _x(vs_one)])
    return [intro, "", *_table(["attention", "processes", "mode", "ms/step", "speedup", "vs 1 process"], rows)]


def _memory(result: Result) -> list[str]:
    meta = result["meta"]
    intro = (
        f"The trainer's memory plan per GPU (an estimate, not a measurement): {meta['gpus']} GPUs x "
        f"{meta['gpu_gib']:g} GiB, {meta['resolution']} px, batch {meta['batch']} per GPU, bf16, gradient "
        "checkpointing, `paper` layers."
    )
    columns = [("ddp", False), ("ddp", True), ("fsdp2", False), ("fsdp2", True)]
    plans = {(r["model"], r["trainable"], r["mode"], r["teacher"]): r for r in result["rows"]}
    rows = []
    for model, trainable in dict.fromkeys((r["model"], r["trainable"]) for r in result["rows"]):
        cells = []
        for mode, teacher in columns:
            plan = plans[(model, trainable, mode, teacher)]
            cells.append(f"{plan['t5_gib']:.1f} GiB" + ("" if plan["fits"] else " (does not fit)"))
        rows.append([model, trainable, *cells])
    extra = [100 * (r["t5_gib"] / r["softmax_gib"] - 1) for r in result["rows"]]
    header = ["model", "trains", "DDP", "DDP + teacher", "FSDP2", "FSDP2 + teacher"]
    note = f"T5 adds {min(extra):.1f}-{max(extra):.1f} % over the same fine-tune of the softmax model."
    return [intro, "", *_table(header, rows), "", note]


def _memory_check(result: Result) -> list[str]:
    meta = result["meta"]
    trained = meta["counts"]["trained"] / 1e6
    intro = (
        f"The memory plan against a measured training step: SD3.5 Medium's real architecture (random weights), "
        f"{meta['resolution']} px, batch 1, `paper` layers, `attention` trainable ({trained:.0f}M parameters), "
        f"bf16, one CPU process; peak resident memory above the {meta['baseline_gib']:.2f} GiB baseline of a "
        "fresh process, the plan without its GPU runtime margin. The bar: within 15%."
    )
    rows = [
        [row["phase"], f"{row['plan_gib']:.2f}", f"{row['measured_gib']:.2f}", f"{row['ratio']:.3f}"]
        + ["yes" if row["within_tolerance"] else "NO"]
        for row in result["rows"]
    ]
    return [intro, "", *_table(["phase", "plan GiB", "measured GiB", "plan / measured", "within 15%"], rows)]


def _stored_table(result: Result) -> list[str]:
    # `benchmarks/ablations.py`, `benchmarks/artifact_probe.py`, `benchmarks/key_bias.py`, `benchmarks/reuse.py`
    # and `benchmarks/schedule.py` store their printed table with the rows: a header line, a description
    # line, a blank line, then the table.
    lines = result["meta"]["table"].splitlines()
    return [lines[1] + ".", "", *lines[3:]]


def _dynamic_vram(result: Result) -> list[str]:
    rows = [
        [item["check"], ("ok" if item["ok"] else "FAIL") if item["applies"] else "n/a", item["evidence"]]
        for item in result["rows"]
    ]
    return [
        "T5 Linearize in a real ComfyUI server (Dynamic VRAM on CUDA).",
        "",
        *_table(["check", "result", "evidence"], rows),
    ]


def _lowvram(result: Result) -> list[str]:
    rows = [[item["check"], "ok" if item["ok"] else "FAIL", item["evidence"]] for item in result["rows"]]
    return [
        "T5 Linearize under ComfyUI's partial (low-VRAM) load with a weight budget of half the model, "
        "against a full load.",
        "",
        *_table(["check", "result", "evidence"], rows),
    ]


def _bytes(count: int) -> str:
    return f"{count / 2**30:.2f} GiB" if count >= 2**30 else f"{count / 2**20:.1f} MiB"


def _file_size(result: Result) -> list[str]:
    meta = result["meta"]
    intro = (
        "Tensor bytes of the exported T5 weights file per layer spec, `--model.trainable` and `--model.rank` (full: "
        "full deltas): the T5 parameters in fp32 and the deltas of trained inherited weights in fp32 "
        "(`--output.base_dtype fp32`) or in the base checkpoint's precision (`--output.base_dtype base`, the default)."
    )
    rows = [
        [
            row["model"],
            row["layers"],
            row["trainable"],
            str(row["rank"] or "full"),
            f"{row['t5_params'] / 1e6:.2f}M",
            f"{row['delta_params'] / 1e6:.1f}M",
            _bytes(row["bytes_fp32"]),
            f"{_bytes(row['bytes_base'])} ({row['base_dtype']})",
        ]
        for row in result["rows"]
    ]
    header = [
        "model",
        "layers",
        "trainable",
        "rank",
        "T5 params",
        "delta params",
        "file, fp32 deltas",
        "file, base precision",
    ]
    lines = [intro, "", *_table(header, rows)]
    if "toy_cost" in meta:
        cost = [
            [row["delta_dtype"], _bytes(row["file_bytes"])]
            + [f"{row[name]:.3f}" for name in ("overall", "color", "shape", "position", "size")]
            + [f"{row['val_loss']:.6f}"]
            for row in meta["toy_cost"]
        ]
        lines += [
            "",
            f"What the smaller file costs on the toy: `{meta['toy_weights']}` as exported (fp32 deltas) and with its "
            f"deltas rounded to float16, ToyEval from the same noise; the two files' samples differ by "
            f"{meta['toy_sample_rms_difference']:.4f} RMS (pixels in [0, 1]).",
            "",
            *_table(["deltas", "file", "ToyEval overall", "color", "shape", "position", "size", "val loss"], cost),
        ]
    return lines


Renderer = Callable[[Result], list[str]]
# (file name pattern, section title, command that writes it, renderer); the first match wins.
SECTIONS: tuple[tuple[str, str, str, Renderer], ...] = (
    (
        "comfy_step_whole_*.json",
        "SD3.5 Medium, one ComfyUI sampling step, whole model",
        "python -m benchmarks.bench_comfy_step",
        _comfy_step_whole,
    ),
    ("attention_*.json", "T5Attention vs SDPA", "python -m benchmarks.bench_attention", _attention),
    (
        "hybrid_attention_*.json",
        "Hybrid joint attention vs SDPA",
        "python -m benchmarks.bench_hybrid_attention",
        _hybrid_attention,
    ),
    ("kernels_sweep_*.json", "Kernel launch settings", "python -m benchmarks.sweep_kernels", _sweep),
    ("kernels_*.json", "Triton kernels", "python -m benchmarks.bench_kernels", _kernels),
    ("comfy_dynamic_vram_*.json", "ComfyUI Dynamic VRAM", "python -m tools.comfy_dynamic_vram", _dynamic_vram),
    ("comfy_lowvram_*.json", "ComfyUI partial (low-VRAM) load", "python -m tools.comfy_lowvram", _lowvram),
    ("file_size.json", "T5 weights file size", "python -m benchmarks.bench_file_size", _file_size),
    ("bench_toy_speed.json", "Toy sampling speed", "python -m benchmarks.bench_toy_speed", _toy_speed),
    ("trainer_throughput.json", "Trainer throughput", "python -m benchmarks.bench_trainer_throughput", _throughput),
    ("trainer_memory.json", "Trainer memory plan", "python -m benchmarks.bench_trainer_memory", _memory),
    (
        "memory_plan_check.json",
        "Memory plan vs a measured step",
        "python -m benchmarks.bench_memory_plan",
        _memory_check,
    ),
    ("ablations*.json", "Toy ablations", "python -m benchmarks.ablations", _stored_table),
    ("artifact_probe*.json", "Artifact probe of a T5 toy file", "python -m benchmarks.artifact_probe", _stored_table),
    ("key_bias.json", "Key bias of the toy teacher", "python -m benchmarks.key_bias", _stored_table),
    ("reuse*.json", "A toy T5 delta file on a fine-tune of its base", "python -m benchmarks.reuse", _stored_table),
    (
        "schedule*.json",
        "Softmax before start_percent, then T5, on the toy",
        "python -m benchmarks.schedule",
        _stored_table,
    ),
)

INTRO = f"""# Benchmarks

Generated by `python -m benchmarks.report` from `benchmarks/results/*.json`; do not edit by hand (a
test checks this file against the results). Each script in `benchmarks/` prints its table, checks
every path against the reference before timing it, and writes its JSON under `benchmarks/results/`.

**One convention for speed ratios:** every speedup is the
{SPEEDUP_VS_SOFTMAX}: above 1 means T5 is faster. Both paths are always
timed in the same run. What the toy ablations show is discussed in [docs/toy.md](../docs/toy.md).

**GPU:** `bash benchmarks/gpu_check.sh` runs every GPU check (the kernel tests on CUDA,
`bench_kernels.py --backward --model-step`, `sweep_kernels.py`, `tools/comfy_dynamic_vram.py`,
`tools/comfy_lowvram.py`, `bench_comfy_step.py` on the whole model); its header says what to carry
to a GPU machine and how to split it under a 10-minute command limit. Its JSON files, copied
into `benchmarks/results/`, get their sections on the next `python -m benchmarks.report`."""


def render(results_dir: Path = RESULTS_DIR) -> str:
    """The whole `benchmarks/README.md` text for the result files in `results_dir`.

    Raises:
        ValueError: a result file that no pattern in `SECTIONS` covers.
    """
    files = sorted(results_dir.glob("*.json"))
    results = {path.name: json.loads(path.read_text(encoding="utf-8")) for path in files}
    lines = [INTRO, ""]
    if all(result["meta"]["device"].startswith("cpu") for result in results.values()):
        lines += ["**Every figure below was measured on a CPU; none on a GPU yet.**", ""]
    for pattern, title, command, renderer in SECTIONS:
        for name in [name for name in results if fnmatch.fnmatch(name, pattern)]:
            result = results.pop(name)
            lines += [f"## {title} (`{name}`)", "", f"`{command}`. {_measured(result)}", ""]
            lines += [*renderer(result), ""]
    if results:
        raise ValueError(
            f"{sorted(results)} in {results_dir} match no section of benchmarks/report.py; add a renderer to "
            "SECTIONS or move the file out of the results folder."
        )
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if benchmarks/README.md is out of date")
    parser.add_argument(
        "--results-dir", type=Path, help="render the result files in this folder and print the text (README untouched)"
    )
    args = parser.parse_args(argv)
    if args.results_dir is not None:
        print(render(args.results_dir), end="")
        return 0
    text = render()
    if args.check:
        if README.read_text(encoding="utf-8") != text:
            print(f"{README} is out of date: run python -m benchmarks.report", file=sys.stderr)
            return 1
        return 0
    README.write_text(text, encoding="utf-8")
    print(f"wrote {README}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""One ComfyUI sampling step of SD3.5 Medium's whole model: softmax against T5 Linearize, through the node.

    python -m benchmarks.bench_comfy_step --sizes 1024 --compose 1024 2048 --warmup 1 --reps 2
    python -m benchmarks.bench_comfy_step --device cuda --dtype bf16 --sizes 1024 --compose 1024 2048 \
        --warmup 2 --reps 5 --block-reps 3  # the GPU row: benchmarks/gpu_check.sh, stage step

The model is ComfyUI's own MMDiT with SD3.5 Medium's architecture and seeded random weights (fp32: about
10 GB; `--blocks N` keeps the first N joint blocks, `--plan` prints the kinds of block each path adds up);
a step is one euler step with CFG 4.5, which ComfyUI runs as one model call of batch 2 or, where it judges
memory short, two of batch 1 (each row records its rounds' calls). Softmax is ComfyUI's attention forced
to SDPA; each T5 path of `--specs` is the `T5Linearize` node's output for a file of seeded random T5
modules (`step_harness.path_layers`); `--compiled` paths also run under ComfyUI's `TorchCompileModel`
(inductor), rows `<path>+compile`, their attention not timed (the probes' Python hooks would break the
graph), each round that compiled a graph left out of the median; composed, each timed block is compiled
alone with the node's settings and the rest of the step runs eager. Before timing,
each path's step must give finite latents that differ from softmax's, and each timed block finite
outputs, else its row says FAIL.

A step's time is measured (`--sizes`: the whole step timed, `step_harness.WholeRun`) or composed
(`--compose`: the rest of the step plus one timed block of each kind, `step_harness.ComposedRun` and
`benchmarks.step_compose`). Where a size is given to both, composed / measured checks the composition:
composed times are trusted at sizes too slow to measure whole only within 5 %. After each path's
warm-up, `--reps` rounds time every path in turn, its whole step and right after it its composed parts
(`--block-reps` runs of each block per round), so a slow stretch of a shared machine hits every path
and both methods alike. Attention share and peak memory are measured as `benchmarks.step_probes` says.
Needs a ComfyUI tree (`--comfyui`, else the one testing/comfy_env.py finds). Writes
`benchmarks/results/comfy_step_whole_<device><suffix>.json` after each size (`--suffix` keeps a
composition check or a composed-only size beside the main table).
"""

from __future__ import annotations

import argparse
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from benchmarks.step_compose import BlockShape, kinds_of
from benchmarks.step_harness import (
    CFG,
    TEXT_TOKENS,
    ComposedRun,
    Step,
    StepPath,
    WholeRun,
    build_model,
    compiled_path,
    convert_paths,
    path_layers,
)
from benchmarks.step_probes import AttentionClock, PeakMemory
from benchmarks.timing import RESULTS_DIR, fmt_ms, fmt_x, header_line, markdown_table, publish, speedup
from t5core.config import BaseArch
from testing import comfy_env
from testing.models import sd35_medium_config

TITLE = "SD3.5 Medium, one ComfyUI sampling step, whole model"
_COMPILED_NOTE = "; `+compile`: under ComfyUI's TorchCompileModel (inductor), its attention not timed"
_COMPILED_COMPOSED_NOTE = "; composed, each timed block compiled alone with the node's settings, the rest eager"
COMPOSITION_GOAL = 0.05
"""Composed and measured steps must agree within 5 % where both are run, for composed times to be trusted."""


def parse_args(depth: int) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="*", default=[1024], help="sizes (px, square) to measure whole")
    parser.add_argument("--compose", type=int, nargs="*", default=[1024, 2048], help="sizes (px) to compose")
    parser.add_argument(
        "--specs", nargs="+", default=["paper", "all", "paper-hybrid", "all-hybrid", "all-hybrid-na"],
        help="T5 paths: layer specs (t5core.layers), `<spec>-hybrid` for hybrid joint attention, a trailing "
        "`-na` for the 5x5 neighbourhood blend",
    )  # fmt: skip
    parser.add_argument("--compiled", nargs="*", default=[], help="paths also run compiled, at every size")
    parser.add_argument("--blocks", type=int, default=depth, help=f"joint blocks kept ({depth} = the whole model)")
    parser.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs first (>= 1: the first is the check)")
    parser.add_argument("--reps", type=int, default=3, help="timed rounds")
    parser.add_argument("--block-reps", type=int, default=1, help="timed runs of each kind of block per composed round")
    parser.add_argument("--suffix", default="", help="appended to the JSON's name: comfy_step_whole_<device><suffix>")
    parser.add_argument("--comfyui", type=Path, help="ComfyUI tree (default: as testing/comfy_env.py finds it)")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR, help="where the JSON goes")
    parser.add_argument("--plan", action="store_true", help="print each path's kinds of block from the config and exit")
    args = parser.parse_args()
    if not 1 <= args.blocks <= depth:
        parser.error(f"--blocks must be 1-{depth}; got {args.blocks}.")
    if args.plan:
        return args
    if args.warmup < 1 or args.reps < 2 or args.block_reps < 1:
        parser.error(
            f"--warmup and --block-reps must be >= 1 and --reps >= 2; got {args.warmup}, {args.block_reps} and "
            f"{args.reps}."
        )
    if not args.sizes and not args.compose:
        parser.error("nothing to do: give --sizes, --compose or both.")
    if unknown := [name for name in args.compiled if name not in ["softmax", *args.specs]]:
        parser.error(f"--compiled {' '.join(unknown)}: not softmax or one of --specs ({' '.join(args.specs)}).")
    if any(size % 16 for size in args.sizes + args.compose):
        parser.error("sizes must be multiples of 16 px (8x VAE, 2x2 patches).")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: this machine has no CUDA device.")
    args.comfyui = args.comfyui.expanduser() if args.comfyui else comfy_env.locate()
    if args.comfyui is None:
        parser.error(f"pass --comfyui; {comfy_env.not_found_message()}")
    if not (args.comfyui / "comfy" / "model_patcher.py").is_file():
        parser.error(f"{args.comfyui} is not a ComfyUI tree; pass --comfyui or set COMFYUI_PATH.")
    return args


def plan(config: dict, blocks: int, specs: list[str]) -> None:
    """Print, per path, how many blocks of each kind a composed step adds up, for the model that
    `build_model(config, blocks, ...)` makes (the run itself reads the kinds from ComfyUI's model)."""
    dual = tuple(i for i in config["dual_attention_layers"] if i < blocks)
    heads, head_dim = config["num_attention_heads"], config["attention_head_dim"]
    arch = BaseArch(depth=blocks, heads=heads, head_dim=head_dim, dual_attention_layers=dual)
    shapes = [BlockShape(i in dual, i == blocks - 1) for i in range(blocks)]
    for name in ["softmax", *specs]:
        layers, joint_mode, _ = ((), "ttt", 0) if name == "softmax" else path_layers(name, arch)
        print(f"{name}: {len(layers)} modules converted")
        for kind, count in Counter(kinds_of(shapes, layers, joint_mode)).items():
            print(f"  {count:>3} x {kind.label()}")


def main() -> None:
    config = sd35_medium_config()
    args = parse_args(config["num_layers"])
    if args.plan:
        plan(config, args.blocks, args.specs)
        return
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    cuda = args.device == "cuda"
    clock, memory = AttentionClock(cuda=cuda), PeakMemory(cuda=cuda)
    rows: list[dict[str, Any]] = []
    calls: set[tuple[int, ...]] = set()
    with tempfile.TemporaryDirectory() as tmp:
        nodes = comfy_env.import_comfy(args.comfyui, Path(tmp), cpu=not cuda, sdpa=True)
        import comfy.utils
        import comfyui_version

        comfy.utils.PROGRESS_BAR_ENABLED = False
        model = build_model(config, args.blocks, dtype)
        paths = convert_paths(nodes, model, args.specs)
        paths += [compiled_path(path) for path in paths if path.name in args.compiled]
        blocks = model.model.diffusion_model.joint_blocks
        shapes = [BlockShape(b.x_block.x_block_self_attn, b.context_block.pre_only) for b in blocks]
        print(header_line())
        for size in dict.fromkeys(args.sizes + args.compose):
            whole = {p.name: WholeRun(Step(nodes, p, config, size, clock), memory) for p in paths if size in args.sizes}
            composed = {
                p.name: ComposedRun(Step(nodes, p, config, size, clock), p, shapes, memory, block_reps=args.block_reps)
                for p in paths
                if size in args.compose
            }
            reference = None
            for path in paths:
                if whole:
                    out = whole[path.name].prepare(reference, warmup=args.warmup)
                    reference = out if path.name == "softmax" else reference
                if path.name in composed:
                    composed[path.name].prepare(warmup=args.warmup)
            # every path in turn, its composed parts right after its whole step: both see one stretch
            in_turn = [run for p in paths for run in (whole.get(p.name), composed.get(p.name)) if run is not None]
            for _ in range(args.reps):
                for run in in_turn:
                    run.round()
            measured = _rows(whole, size, "measured", calls)
            _finish(measured, paths, rows)
            by_path = _rows(composed, size, "composed", calls)
            _compare(by_path, measured)
            _finish(by_path, paths, rows)
            _save(args, config, rows, comfyui=comfyui_version.__version__, calls=calls, memory=memory)


def _save(args, config: dict, rows: list[dict[str, Any]], *, comfyui: str, calls: set, memory: PeakMemory) -> None:
    """Write and print the rows so far (after each size, so that a stopped run keeps what it measured)."""
    meta = {"blocks": args.blocks, "depth": config["num_layers"], "dtype": args.dtype, "comfyui": comfyui}
    meta.update(text_tokens=TEXT_TOKENS, cfg=CFG, model_calls_per_step=sorted(calls), softmax="sdpa")
    meta.update(measured_sizes=args.sizes, composed_sizes=args.compose, warmup=args.warmup, reps=args.reps,
                block_reps=args.block_reps)  # fmt: skip
    meta["attention_method"] = (
        "AttentionClock (benchmarks/step_probes.py): optimized_attention_override and T5Attention forward "
        f"hooks, {'CUDA events' if memory.cuda else 'perf_counter'}"
    )
    meta.update(memory_method=memory.method, composition_goal=f"composed within {COMPOSITION_GOAL:.0%} of measured")
    meta["composition_tolerance"] = COMPOSITION_GOAL
    publish(f"comfy_step_whole_{args.device}{args.suffix}", rows, meta, table=table, directory=args.results_dir)


def _rows(runs: dict, size: int, step: str, calls: set) -> dict[str, dict[str, Any]]:
    """One size's rows of one kind (`step`: measured or composed), by path; adds the model-call batches to `calls`."""
    calls.update(*(run.step.calls for run in runs.values()))
    return {name: {"size": size, "path": name, "step": step, **run.result(), "windows": run.step.windows()}
            for name, run in runs.items()}  # fmt: skip


def _compare(composed: dict[str, dict[str, Any]], measured: dict[str, dict[str, Any]]) -> None:
    """Add composed / measured (medians, rounds, peaks) to the composed rows whose path was measured too, both ok."""
    for name, row in composed.items():
        whole = measured.get(name, {})
        if whole.get("status") == "ok" and row["status"] == "ok":
            row["composed_vs_measured"] = row["median_ms"] / whole["median_ms"]
            rounds = zip(row["round_ms"], whole["times_ms"], strict=True)
            row["composed_vs_measured_rounds"] = [part / step for part, step in rounds]
            row["peak_composed_vs_measured"] = row["peak_mib"] / whole["peak_mib"]


def _finish(by_path: dict[str, dict[str, Any]], paths: list[StepPath], rows: list[dict[str, Any]]) -> None:
    """Add modules, speedup and attention share to one size's rows of one kind (if any) and keep them."""
    if not by_path:
        return
    base = by_path["softmax"]
    for path in (path for path in paths if path.name in by_path):
        row = by_path[path.name]
        row["layers"], row["joint_mode"], row["modules"] = list(path.layers), path.joint_mode, len(path.layers)
        row["compiled"] = path.compiled
        if row["status"] == "ok" and base["status"] == "ok":
            row["speedup_vs_softmax"] = speedup(base["median_ms"], row["median_ms"])
            row["attention_share"] = None if row["attention_ms"] is None else row["attention_ms"] / row["median_ms"]
        elif row["status"] == "ok":
            row["status"] = "softmax FAIL"
        rows.append(row)


def table(result: dict[str, Any]) -> list[str]:
    """The markdown table: per size and path, the step measured or composed, and the composition check."""
    meta = result["meta"]
    model = (
        "SD3.5 Medium's architecture (24 joint blocks, `attn2` on blocks 0-12)"
        if meta["blocks"] == meta["depth"]
        else f"**only the first {meta['blocks']} of SD3.5 Medium's {meta['depth']} joint blocks**"
    )
    compiled = [row["step"] for row in result["rows"] if row.get("compiled")]
    compiled_note = (_COMPILED_NOTE if compiled else "") + (_COMPILED_COMPOSED_NOTE if "composed" in compiled else "")
    batch = " or ".join(
        f"{len(calls)} model call{'s' if len(calls) > 1 else ''} of batch {'/'.join(map(str, calls))}"
        for calls in meta["model_calls_per_step"]
    )
    intro = (
        f"One ComfyUI {meta['comfyui']} sampling step of {model} with random weights: one euler step, CFG "
        f"{meta['cfg']:g} (cond and uncond: {batch} per step, as ComfyUI chose), {meta['text_tokens']} text tokens, "
        f"{meta['dtype']}; softmax is SDPA, T5 runs through the T5Linearize node (`-hybrid`: hybrid joint "
        f"attention, exact softmax wherever text takes part{compiled_note}). "
        "Step *measured*: the whole step timed (median of "
        f"{meta['reps']} after {meta['warmup']} warm-up). Step *composed*: the time of everything but the joint "
        "blocks plus, for every block, the time of one block of its kind, timed inside the same model's step "
        f"({meta.get('block_reps', 1)} time{'s' if meta.get('block_reps', 1) > 1 else ''} a round); "
        f"where both ran, composed / measured checks the composition (goal: {meta['composition_goal']}). "
        "Attention share: time inside attention calls / step time. Peak: "
        f"{meta['memory_method']}; for a composed row, the peak of the step that times its blocks (every kind "
        "of block the path has, in turn)."
    )
    softmax = {(r["size"], r["step"]): r.get("median_ms") for r in result["rows"] if r["path"] == "softmax"}
    rows = []
    for row in result["rows"]:
        head = [f"{row['size']}x{row['size']}", f"`{row['path']}`", row["modules"], row["step"]]
        if row["status"] != "ok":
            rows.append([*head, row["status"], "", "", "", ""])
            continue
        ratio = speedup(softmax[(row["size"], row["step"])], row["median_ms"])
        share = "-" if row.get("attention_share") is None else f"{row['attention_share']:.0%}"
        cells = [fmt_ms(row["median_ms"]), fmt_x(ratio), share, f"{row['peak_mib']:.0f}"]
        check = row.get("composed_vs_measured")
        rows.append([*head, *cells, f"{check:.3f}" if check is not None else "-"])
    header = ["image", "path", "modules converted", "step", "ms", "speedup", "attention share", "peak MiB",
              "composed / measured"]  # fmt: skip
    checks = []
    for size in dict.fromkeys(row["size"] for row in result["rows"]):
        compared = [row for row in result["rows"] if row["size"] == size and "composed_vs_measured" in row]
        if compared:
            ratios = [row["composed_vs_measured"] for row in compared]
            rounds = [ratio for row in compared for ratio in row.get("composed_vs_measured_rounds", ())]
            met = all(abs(ratio - 1) <= meta["composition_tolerance"] for ratio in ratios)
            verdict = "goal met" if met else "goal NOT met: the composed rows are not validated"
            span = f"{min(ratios):.3f}-{max(ratios):.3f} over {len(ratios)} paths ({verdict})"
            by_round = f"; round by round {min(rounds):.3f}-{max(rounds):.3f}" if rounds else ""
            checks.append(f"* composed / measured at {size}x{size}: {span}{by_round}")
    recompiled = [row for row in result["rows"] if any(row.get("round_graphs", ()))]
    checks += [f"* `{r['path']}` {r['step']} at {r['size']}x{r['size']}: graphs compiled in timed rounds "
               f"{r['round_graphs']}{_calls(r)}, those rounds not in its median" for r in recompiled]  # fmt: skip
    checks += [f"* {meta[key]}" for key in ("recomposed", "note") if key in meta]
    return [intro, "", *markdown_table(header, rows), *([""] + checks if checks else [])]


def _calls(row: dict[str, Any]) -> str:
    """` (model calls ...)` for a measured row, which records its rounds' model calls; "" for a composed one."""
    return f" (model calls {row['round_calls']})" if "round_calls" in row else ""


if __name__ == "__main__":
    main()

"""One ComfyUI sampling step of SD3.5 Medium's whole model: softmax against T5 Linearize, through the node.

The measurement (both in one run, one JSON; estimates for 2 otherwise idle CPU cores, fp32):

    python -m benchmarks.bench_comfy_step --sizes 1024 --compose 1024 2048 --warmup 1 --reps 2  # ~2.5-3.5 h
    python -m benchmarks.bench_comfy_step --device cuda --dtype bf16 --sizes 1024 --compose 1024 2048  # GPU: ~2 min

and a smoke test at toy size (seconds): `--blocks 2 --sizes 128 --compose 128 --warmup 1 --reps 2`.

The model is ComfyUI's own MMDiT with SD3.5 Medium's architecture (24 joint blocks, 24 heads x 64,
MMDiT-X `attn2` on blocks 0-12, q/k RMSNorm) and seeded random weights; `--blocks N` keeps only the
first N blocks, for smoke tests. A step is `nodes.common_ksampler` with one euler step and CFG 4.5:
cond and uncond (154 text tokens each) batched into one model call of batch 2, which the script
checks. Softmax is ComfyUI's attention forced to PyTorch SDPA. Each T5 path is the output of the
`T5Linearize` node, loaded into ComfyUI as a custom node pack, given a file of seeded random T5
modules for its layer spec: `paper`, `all`, and `<spec>-hybrid` for the same modules with
`T5Config.joint_mode = "hybrid"` (exact softmax wherever text takes part, T5 between image tokens;
only joint `attn` modules change). Before timing, each path's step must give finite latents that
differ from softmax's, else its row says FAIL.

Two ways to get a step's time, and the table says which each row used:

* measured (`--sizes`): the whole step, timed (`benchmarks.timing.time_fn`).
* composed (`--compose`): `rest + sum over the blocks of its kind's time` (`benchmarks.step_compose`).
  Each path's kinds of block are timed in that path's own converted model, inside a real sampling
  step whose other blocks pass their inputs through (ComfyUI's `patches_replace["dit"]` hook), so a
  timed block sees the hidden states, 154 text tokens and conditioning vector of the real step. The
  rest is that step with every block passing through. At a size given to both, composed / measured is
  printed: the composition is trusted at sizes too slow to measure whole only if it is within 5 %.

Attention share is the time inside attention calls over the step time, and peak memory is above what
the process held before the step (model, T5 modules, inputs); `benchmarks.step_probes` says how both
are measured. Needs a ComfyUI tree (`--comfyui`, else the one testing/comfy_env.py finds). Writes
`benchmarks/results/comfy_step_whole_<device>.json`.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.step_compose import BlockKind, BlockShape, compose, kinds_of
from benchmarks.step_probes import AttentionClock, PeakMemory
from benchmarks.timing import RESULTS_DIR, SPEEDUP_VS_SOFTMAX, header_line, speedup, time_fn, write_json
from t5core import T5Attention
from t5core.layers import resolve_layers
from testing import comfy_env
from testing.comfy_tiny import write_t5_weights
from testing.models import sd35_medium_config

REPO_ROOT = Path(__file__).resolve().parent.parent
TEXT_TOKENS = 154
CFG = 4.5
HYBRID = "-hybrid"
COMPOSITION_GOAL = 0.05
"""Composed and measured steps must agree within 5 % where both are run (issue 20)."""


@dataclass
class StepPath:
    """One row family of the table: a model and what it converts."""

    name: str
    layers: tuple[str, ...]
    joint_mode: str
    patcher: Any


def build_model(config: dict, blocks: int, dtype: torch.dtype):
    """ComfyUI's SD3 model with a diffusers `SD3Transformer2DModel` config, its first `blocks` joint
    blocks and seeded random weights."""
    import comfy.model_management
    import comfy.model_patcher
    import comfy.supported_models

    unet = dict(
        in_channels=config["in_channels"],
        out_channels=config["out_channels"],
        patch_size=config["patch_size"],
        depth=config["num_layers"],
        num_blocks=blocks,
        adm_in_channels=config["pooled_projection_dim"],
        pos_embed_max_size=config["pos_embed_max_size"],
        num_patches=config["pos_embed_max_size"] ** 2,
        qk_norm="rms" if config["qk_norm"] == "rms_norm" else None,
        x_block_self_attn_layers=[i for i in config["dual_attention_layers"] if i < blocks],
        pos_embed_scaling_factor=None,
        context_embedder_config={
            "target": "torch.nn.Linear",
            "params": {
                "in_features": config["joint_attention_dim"],
                "out_features": config["num_attention_heads"] * config["attention_head_dim"],
            },
        },
    )
    model_config = comfy.supported_models.SD3(unet)
    model_config.set_inference_dtype(dtype, None)
    torch.manual_seed(0)
    model = model_config.get_model({})
    with torch.no_grad():
        for param in model.diffusion_model.parameters():
            param.normal_(0.0, 0.02)
    mm = comfy.model_management
    return comfy.model_patcher.ModelPatcher(model, mm.get_torch_device(), mm.unet_offload_device())


def convert_paths(nodes, model, specs: list[str]) -> list[StepPath]:
    """Softmax, then one path per spec: the `T5Linearize` node's output for a file of that spec's modules,
    written into the node's models folder."""
    import folder_paths

    from t5core.hosts.comfy import arch_of

    loaded = asyncio.run(nodes.load_custom_node(str(REPO_ROOT)))
    if not loaded or "T5Linearize" not in nodes.NODE_CLASS_MAPPINGS:
        raise RuntimeError(f"ComfyUI did not load {REPO_ROOT} as a custom node pack; see its log lines above.")
    node, arch = nodes.NODE_CLASS_MAPPINGS["T5Linearize"], arch_of(model)
    weights_dir = Path(folder_paths.get_folder_paths("t5_linearize")[0])
    paths = [StepPath("softmax", (), "ttt", model)]
    for name in specs:
        spec, joint_mode = (name[: -len(HYBRID)], "hybrid") if name.endswith(HYBRID) else (name, "ttt")
        layers = resolve_layers(spec, arch)
        file = f"{name.replace(':', '_').replace(',', '+')}.safetensors"
        write_t5_weights(
            weights_dir / file,
            arch,
            layers,
            seed=1,
            fast_weight_std=None,
            made_by="bench_comfy_step",
            joint_mode=joint_mode,
        )
        patched = node.execute(model=model, weights=file, layers="", enabled=True).result[0]
        paths.append(StepPath(name, layers, joint_mode, patched))
    return paths


class Step:
    """One sampling step of a path at one size, instrumented: a clone of the path's patcher with an
    `APPLY_MODEL` wrapper (records the batch of every model call and the running diffusion model),
    the attention clock on both attention call sites, and optional `dit` block replacements."""

    KEY = "bench_comfy_step"

    def __init__(self, nodes, path: StepPath, config: dict, size: int, clock: AttentionClock) -> None:
        import comfy.patcher_extension
        from t5core.hosts.comfy import KEY as T5_KEY

        self.nodes, self.clock, self.batches, self.diffusion = nodes, clock, [], None
        self.patcher = path.patcher.clone()
        self.patcher.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.APPLY_MODEL, self.KEY, self._wrapper())
        options = self.patcher.model_options["transformer_options"]
        # a plain function, not a bound method: ComfyUI deep-copies model_options, and a deep copy of a
        # bound method would copy the clock with it
        options["optimized_attention_override"] = lambda func, *args, **kwargs: clock.override(func, *args, **kwargs)
        t5 = path.patcher.get_additional_models_with_key(T5_KEY)
        self.t5_modules = [m for p in t5 for m in p.model.modules() if isinstance(m, T5Attention)]
        generator = torch.Generator().manual_seed(2)
        self.conds = [
            [[torch.randn(1, TEXT_TOKENS, config["joint_attention_dim"], generator=generator),
              {"pooled_output": torch.randn(1, config["pooled_projection_dim"], generator=generator)}]]
            for _ in range(2)
        ]  # fmt: skip
        self.latent = {"samples": torch.zeros(1, 16, size // 8, size // 8)}

    def _wrapper(self):
        def wrapper(executor, x, *args, **kwargs):
            self.batches.append(x.shape[0])
            self.diffusion = executor.class_obj.diffusion_model
            return executor(x, *args, **kwargs)

        return wrapper

    def replace_blocks(self, make) -> None:
        """Route every joint block `i` through `make(i)`, a ComfyUI `dit` double-block replacement."""
        for index in range(len(self.patcher.model.diffusion_model.joint_blocks)):
            self.patcher.set_model_patch_replace(make(index), "dit", "double_block", index)

    def __call__(self) -> torch.Tensor:
        with torch.no_grad(), self.clock.hooked(self.t5_modules):
            return self.nodes.common_ksampler(
                self.patcher, 0, 1, CFG, "euler", "sgm_uniform", self.conds[0], self.conds[1], self.latent
            )[0]["samples"]


def _timed(run, *, warmup: int, reps: int, clock: AttentionClock, memory: PeakMemory) -> dict[str, float]:
    """Time `run` (its warmup calls already made), with its attention per call and peak memory."""
    clock.take_ms()
    memory.start()
    timing = time_fn(run, warmup=0, reps=reps)
    attention = clock.take_ms() / reps
    peak, held = memory.stop_mib()
    return {**timing, "attention_ms": attention, "peak_mib": peak, "held_mib": held}


def measure_whole(step: Step, reference: torch.Tensor | None, args, clock, memory) -> dict[str, Any]:
    """The whole step, timed; `status` FAIL when a T5 path's latents are not finite or equal softmax's."""
    out = step()
    for _ in range(args.warmup - 1):
        step()
    if reference is not None and not (torch.isfinite(out).all() and not torch.equal(out, reference)):
        return {"status": "FAIL", "latents": out}
    timed = _timed(step, warmup=args.warmup, reps=args.reps, clock=clock, memory=memory)
    return {**timed, "status": "ok", "latents": out}


def measure_composed(step: Step, path: StepPath, shapes: list[BlockShape], args, clock, memory) -> dict[str, Any]:
    """Rest and one block of each kind the path has, timed inside the path's own sampling step."""
    kinds = kinds_of(shapes, path.layers, path.joint_mode)
    first = {kind: kinds.index(kind) for kind in dict.fromkeys(kinds)}
    timed_at = {index: kind for kind, index in first.items()}
    blocks: dict[BlockKind, dict[str, Any]] = {}
    state = {"measure": False}

    def make(index: int):
        def replacement(args_: dict, extra: dict) -> dict:
            kind = timed_at.get(index) if state["measure"] else None
            if kind is not None:
                block = step.diffusion.joint_blocks[index]

                def run():
                    return block(args_["txt"], args_["img"], c=args_["vec"], use_checkpoint=False,
                                 transformer_options=args_["transformer_options"])  # fmt: skip

                finite = all(t is None or bool(torch.isfinite(t).all()) for t in run())
                for _ in range(args.warmup - 1):
                    run()
                clock.take_ms()
                timing = time_fn(run, warmup=0, reps=args.reps)
                blocks[kind] = {**timing, "attention_ms": clock.take_ms() / args.reps, "finite": finite}
            return {"txt": args_["txt"], "img": args_["img"]}

        return replacement

    step.replace_blocks(make)
    for _ in range(args.warmup):
        step()
    rest = _timed(step, warmup=args.warmup, reps=args.reps, clock=clock, memory=memory)
    state["measure"] = True
    memory.start()
    step()
    peak, held = memory.stop_mib()
    ok = all(block["finite"] for block in blocks.values())
    per_kind = {kind: block["median_ms"] for kind, block in blocks.items()}
    attention = {kind: block["attention_ms"] for kind, block in blocks.items()}
    return {
        "median_ms": compose(rest["median_ms"], per_kind, kinds),
        "attention_ms": compose(rest["attention_ms"], attention, kinds),
        "peak_mib": max(peak, rest["peak_mib"]),
        "held_mib": held,
        "rest_ms": rest["median_ms"],
        "rest_attention_ms": rest["attention_ms"],
        "blocks": [
            {"kind": kind.label(), "count": kinds.count(kind), "timed_block": first[kind], **blocks[kind]}
            for kind in first
        ],
        "status": "ok" if ok else "FAIL",
    }


def parse_args(depth: int) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="*", default=[1024], help="sizes (px, square) to measure whole")
    parser.add_argument("--compose", type=int, nargs="*", default=[1024, 2048], help="sizes (px) to compose")
    parser.add_argument(
        "--specs", nargs="+", default=["paper", "all", "paper-hybrid", "all-hybrid"],
        help="T5 paths: layer specs (t5core.layers), `<spec>-hybrid` for hybrid joint attention",
    )  # fmt: skip
    parser.add_argument("--blocks", type=int, default=depth, help=f"joint blocks kept ({depth} = the whole model)")
    parser.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs first (>= 1: the first is the check)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--comfyui", type=Path, help="ComfyUI tree (default: as testing/comfy_env.py finds it)")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR, help="where the JSON goes")
    args = parser.parse_args()
    if not 1 <= args.blocks <= depth:
        parser.error(f"--blocks must be 1-{depth}; got {args.blocks}.")
    if args.warmup < 1 or args.reps < 2:
        parser.error(f"--warmup must be >= 1 and --reps >= 2; got {args.warmup} and {args.reps}.")
    if not args.sizes and not args.compose:
        parser.error("nothing to do: give --sizes, --compose or both.")
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


COLUMNS = (
    f"{'size':>9} {'path':>12} {'modules':>7} {'step':>8} {'ms':>9} {'p20-p80':>15} {'speedup':>8} "
    f"{'attention':>9} {'peak MiB':>9}"
)


def _line(row: dict[str, Any]) -> str:
    head = f"{row['size']:>4}x{row['size']:<4} {row['path']:>12} {row['modules']:>7} {row['step']:>8}"
    if row["status"] != "ok":
        return f"{head} {'FAIL':>9}"
    spread = f"{row['p20_ms']:.0f}-{row['p80_ms']:.0f}" if "p20_ms" in row else "-"
    text = (
        f"{head} {row['median_ms']:>9.0f} {spread:>15} {row['speedup_vs_softmax']:>7.2f}x "
        f"{row['attention_share']:>9.1%} {row['peak_mib']:>9.0f}"
    )
    if "composed_vs_measured" in row:
        within = abs(row["composed_vs_measured"] - 1) <= COMPOSITION_GOAL
        text += f"  composed / measured {row['composed_vs_measured']:.3f} ({'within' if within else 'NOT within'} 5%)"
    return text


def main() -> None:
    config = sd35_medium_config()
    args = parse_args(config["num_layers"])
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    cuda = args.device == "cuda"
    clock, memory = AttentionClock(cuda=cuda), PeakMemory(cuda=cuda)
    rows: list[dict[str, Any]] = []
    batches: set[tuple[int, ...]] = set()
    with tempfile.TemporaryDirectory() as tmp:
        nodes = comfy_env.import_comfy(args.comfyui, Path(tmp), cpu=not cuda, sdpa=True)
        import comfy.utils
        import comfyui_version

        comfy.utils.PROGRESS_BAR_ENABLED = False
        model = build_model(config, args.blocks, dtype)
        paths = convert_paths(nodes, model, args.specs)
        blocks = model.model.diffusion_model.joint_blocks
        shapes = [BlockShape(b.x_block.x_block_self_attn, b.context_block.pre_only) for b in blocks]
        print(header_line())
        print(
            f"model: ComfyUI {comfyui_version.__version__} MMDiT, SD3.5 Medium architecture, {args.blocks} of "
            f"{config['num_layers']} blocks, random weights, {args.dtype}; one euler step, CFG {CFG} (cond + uncond "
            f"batched), {TEXT_TOKENS} text tokens; softmax = SDPA; T5 through the T5Linearize node"
        )
        print(COLUMNS)
        for size in dict.fromkeys(args.sizes + args.compose):
            measured: dict[str, dict[str, Any]] = {}
            if size in args.sizes:
                reference = None
                for path in paths:
                    step = Step(nodes, path, config, size, clock)
                    result = measure_whole(step, reference, args, clock, memory)
                    reference = result.pop("latents") if path.name == "softmax" else reference
                    result.pop("latents", None)
                    batches.add(tuple(step.batches))
                    measured[path.name] = {"size": size, "path": path.name, "step": "measured", **result}
                _finish(measured, paths, rows)
            if size in args.compose:
                composed = {}
                for path in paths:
                    step = Step(nodes, path, config, size, clock)
                    result = measure_composed(step, path, shapes, args, clock, memory)
                    row = {"size": size, "path": path.name, "step": "composed", **result}
                    if measured.get(path.name, {}).get("status") == "ok" and result["status"] == "ok":
                        row["composed_vs_measured"] = result["median_ms"] / measured[path.name]["median_ms"]
                        row["peak_composed_vs_measured"] = result["peak_mib"] / measured[path.name]["peak_mib"]
                    composed[path.name] = row
                _finish(composed, paths, rows)
    print(f"speedup = {SPEEDUP_VS_SOFTMAX}; attention = time inside attention calls / step time")
    meta = {
        "blocks": args.blocks,
        "depth": config["num_layers"],
        "dtype": args.dtype,
        "comfyui": comfyui_version.__version__,
        "text_tokens": TEXT_TOKENS,
        "cfg": CFG,
        "model_calls_per_step": sorted(batches),
        "softmax": "sdpa",
        "measured_sizes": args.sizes,
        "composed_sizes": args.compose,
        "warmup": args.warmup,
        "reps": args.reps,
        "attention_method": "AttentionClock (benchmarks/step_probes.py): optimized_attention_override + T5Attention "
        f"forward hooks, {'CUDA events' if cuda else 'perf_counter'}",
        "memory_method": memory.method,
        "composition_goal": f"composed within {COMPOSITION_GOAL:.0%} of measured",
    }
    write_json(f"comfy_step_whole_{args.device}", rows, meta, directory=args.results_dir)


def _finish(by_path: dict[str, dict[str, Any]], paths: list[StepPath], rows: list[dict[str, Any]]) -> None:
    """Add modules, speedup and attention share to one size's rows of one kind, print and keep them."""
    base = by_path["softmax"]
    for path in paths:
        row = by_path[path.name]
        row["layers"], row["joint_mode"], row["modules"] = list(path.layers), path.joint_mode, len(path.layers)
        if row["status"] == "ok" and base["status"] == "ok":
            row["speedup_vs_softmax"] = speedup(base["median_ms"], row["median_ms"])
            row["attention_share"] = row["attention_ms"] / row["median_ms"]
        elif row["status"] == "ok":
            row["status"] = "softmax FAIL"
        print(_line(row))
        rows.append(row)


if __name__ == "__main__":
    main()

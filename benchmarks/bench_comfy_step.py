"""One ComfyUI sampling step of an SD3.5-Medium-config model: softmax against T5 Linearize.

    python benchmarks/bench_comfy_step.py                        # 512x512 and 1024x1024, specs paper and all
    python benchmarks/bench_comfy_step.py --sizes 512 --blocks 4 --reps 2   # a smaller, quicker model

The model is ComfyUI's own MMDiT with SD3.5 Medium's configuration (24 heads x 64, MMDiT-X `attn2`
on blocks 0-12, q/k RMSNorm) and random weights; `--blocks` keeps only the first N joint blocks (same
width) for machines that cannot hold or run all 24. One step is `nodes.common_ksampler` with one
euler step: one CFG evaluation (cond and uncond batched, 154 text tokens each). ComfyUI's softmax
attention is forced to PyTorch SDPA so the baseline is SDPA on every device. T5 modules are random
too (the file is written by `t5core.weights.save`); each converted model is checked before timing:
finite latents that differ from softmax's, else the row says FAIL. Needs a ComfyUI tree
(`--comfyui`, else `COMFYUI_PATH`, else `~/comfy/ComfyUI`). Writes `benchmarks/results/comfy_step_<device>.json`.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from benchmarks.timing import SPEEDUP_VS_SOFTMAX, header_line, speedup, time_fn, write_json  # noqa: E402
from t5core import T5Attention, T5Config  # noqa: E402
from t5core.layers import resolve_layers  # noqa: E402
from t5core.weights import save as save_t5_weights  # noqa: E402

SD35_MEDIUM_DEPTH = 24
SD35_MEDIUM_ATTN2 = tuple(range(13))
TEXT_TOKENS = 154


def import_comfy(root: Path, cpu: bool):
    """Import ComfyUI as its `main.py` would (its folder first on sys.path), with SDPA attention."""
    if not (root / "comfy" / "model_patcher.py").is_file():
        raise SystemExit(f"{root} is not a ComfyUI tree; pass --comfyui or set COMFYUI_PATH.")
    sys.path.insert(0, str(root))
    from comfy.cli_args import args

    args.cpu = cpu
    args.use_pytorch_cross_attention = True
    import comfy.model_management
    import comfy.model_patcher
    import comfy.supported_models

    import nodes

    return comfy, nodes


def build_model(comfy, blocks: int, dtype: torch.dtype):
    """ComfyUI's SD3 model with SD3.5 Medium's configuration and seeded random weights."""
    unet = dict(
        in_channels=16,
        out_channels=16,
        patch_size=2,
        depth=SD35_MEDIUM_DEPTH,
        num_blocks=blocks,
        adm_in_channels=2048,
        pos_embed_max_size=384,
        num_patches=384 * 384,
        qk_norm="rms",
        x_block_self_attn_layers=[i for i in SD35_MEDIUM_ATTN2 if i < blocks],
        pos_embed_scaling_factor=None,
        context_embedder_config={
            "target": "torch.nn.Linear",
            "params": {"in_features": 4096, "out_features": 64 * SD35_MEDIUM_DEPTH},
        },
    )
    config = comfy.supported_models.SD3(unet)
    config.set_inference_dtype(dtype, None)
    torch.manual_seed(0)
    model = config.get_model({})
    with torch.no_grad():
        for param in model.diffusion_model.parameters():
            param.normal_(0.0, 0.02)
    mm = comfy.model_management
    return comfy.model_patcher.ModelPatcher(model, mm.get_torch_device(), mm.unet_offload_device())


def write_weights(path: Path, arch, spec: str) -> Path:
    layers = resolve_layers(spec, arch)
    config = T5Config(layers=layers)
    torch.manual_seed(1)
    modules = {name: T5Attention.from_config(config, arch.heads, arch.head_dim) for name in layers}
    return save_t5_weights(path, modules, arch=arch, config=config, provenance={"made_by": "bench_comfy_step"})


def one_step(nodes, model, size: int):
    generator = torch.Generator().manual_seed(2)
    conds = [
        [
            [
                torch.randn(1, TEXT_TOKENS, 4096, generator=generator),
                {"pooled_output": torch.randn(1, 2048, generator=generator)},
            ]
        ]
        for _ in range(2)
    ]
    latent = {"samples": torch.zeros(1, 16, size // 8, size // 8)}

    def run():
        with torch.no_grad():
            return nodes.common_ksampler(model, 0, 1, 4.5, "euler", "sgm_uniform", conds[0], conds[1], latent)[0][
                "samples"
            ]

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[512, 1024], help="square image sizes in pixels")
    parser.add_argument("--specs", nargs="+", default=["paper", "all"], help="T5 layer specs to time")
    parser.add_argument("--blocks", type=int, default=SD35_MEDIUM_DEPTH, help="joint blocks kept (24 = full model)")
    parser.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--comfyui", type=Path, default=Path(os.environ.get("COMFYUI_PATH", Path.home() / "comfy" / "ComfyUI"))
    )
    args = parser.parse_args()
    if not 1 <= args.blocks <= SD35_MEDIUM_DEPTH:
        raise SystemExit(f"--blocks must be 1-{SD35_MEDIUM_DEPTH}; got {args.blocks}.")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    comfy, nodes = import_comfy(args.comfyui.expanduser(), cpu=args.device == "cpu")
    from t5core.hosts.comfy import arch_of, converted_layers, linearize

    model = build_model(comfy, args.blocks, dtype)
    arch = arch_of(model)
    print(header_line())
    print(
        f"model: ComfyUI MMDiT, SD3.5 Medium config, {args.blocks} of 24 blocks, {args.dtype}; one euler step, "
        f"CFG batch 2, {TEXT_TOKENS} text tokens; softmax = SDPA"
    )
    print(f"{'size':>9} {'path':>6} {'modules':>8} {'median ms':>10} {'p20-p80 ms':>19} {'speedup':>10}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        variants = {"softmax": model}
        for spec in args.specs:
            variants[spec] = linearize(model, write_weights(Path(tmp) / f"{spec}.safetensors", arch, spec))
        for size in args.sizes:
            steps = {name: one_step(nodes, patcher, size) for name, patcher in variants.items()}
            reference = steps["softmax"]()
            baseline = None
            for name, run in steps.items():
                modules = len(converted_layers(variants[name]))
                if name != "softmax":
                    out = run()
                    if not (torch.isfinite(out).all() and not torch.equal(out, reference)):
                        print(f"{size:>4}x{size:<4} {name:>6} {modules:>8} {'FAIL':>10}")
                        rows.append({"size": size, "path": name, "modules": modules, "status": "FAIL"})
                        continue
                timing = time_fn(run, warmup=args.warmup, reps=args.reps)
                baseline = timing["median_ms"] if name == "softmax" else baseline
                ratio = speedup(baseline, timing["median_ms"])
                spread = f"{timing['p20_ms']:.0f}-{timing['p80_ms']:.0f}"
                median = timing["median_ms"]
                print(f"{size:>4}x{size:<4} {name:>6} {modules:>8} {median:>10.0f} {spread:>19} {ratio:>9.2f}x")
                rows.append(
                    {
                        "size": size,
                        "path": name,
                        "modules": modules,
                        **timing,
                        "speedup_vs_softmax": ratio,
                        "status": "ok",
                    }
                )
    print(f"speedup = {SPEEDUP_VS_SOFTMAX}")
    meta = {
        "blocks": args.blocks,
        "dtype": args.dtype,
        "text_tokens": TEXT_TOKENS,
        "softmax": "sdpa",
        "steps": 1,
        "cfg_batch": 2,
    }
    write_json(f"comfy_step_{args.device}", rows, meta)


if __name__ == "__main__":
    main()

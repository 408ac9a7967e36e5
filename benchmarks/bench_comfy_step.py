"""One ComfyUI sampling step of an SD3.5-Medium-config model: softmax against T5 Linearize.

    python -m benchmarks.bench_comfy_step                        # 512x512 and 1024x1024, specs paper and all
    python -m benchmarks.bench_comfy_step --sizes 512 --blocks 4 --reps 2   # a smaller, quicker model

The model is ComfyUI's own MMDiT with SD3.5 Medium's configuration (24 heads x 64, MMDiT-X `attn2`
on blocks 0-12, q/k RMSNorm) and random weights; `--blocks` keeps only the first N joint blocks (same
width) for machines that cannot hold or run all 24. One step is `nodes.common_ksampler` with one
euler step: one CFG evaluation (cond and uncond batched, 154 text tokens each). ComfyUI's softmax
attention is forced to PyTorch SDPA so the baseline is SDPA on every device. T5 modules are random
too (the file is written by `t5core.weights.save`); each converted model is checked before timing:
finite latents that differ from softmax's, else the row says FAIL. Needs a ComfyUI tree (`--comfyui`,
else the one testing/comfy_env.py finds). Writes `benchmarks/results/comfy_step_<device>.json`.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from benchmarks.timing import SPEEDUP_VS_SOFTMAX, header_line, speedup, time_fn, write_json
from t5core.layers import resolve_layers
from testing import comfy_env
from testing.comfy_tiny import write_t5_weights
from testing.models import sd35_medium_config

TEXT_TOKENS = 154


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


def one_step(nodes, model, config: dict, size: int):
    generator = torch.Generator().manual_seed(2)
    conds = [
        [
            [
                torch.randn(1, TEXT_TOKENS, config["joint_attention_dim"], generator=generator),
                {"pooled_output": torch.randn(1, config["pooled_projection_dim"], generator=generator)},
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


def parse_args(depth: int) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[512, 1024], help="square image sizes in pixels")
    parser.add_argument("--specs", nargs="+", default=["paper", "all"], help="T5 layer specs to time")
    parser.add_argument("--blocks", type=int, default=depth, help=f"joint blocks kept ({depth} = full model)")
    parser.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--comfyui", type=Path, help="ComfyUI tree (default: as testing/comfy_env.py finds it)")
    args = parser.parse_args()
    if not 1 <= args.blocks <= depth:
        parser.error(f"--blocks must be 1-{depth}; got {args.blocks}.")
    args.comfyui = args.comfyui.expanduser() if args.comfyui else comfy_env.locate()
    if args.comfyui is None:
        parser.error(f"pass --comfyui; {comfy_env.not_found_message()}")
    if not (args.comfyui / "comfy" / "model_patcher.py").is_file():
        parser.error(f"{args.comfyui} is not a ComfyUI tree; pass --comfyui or set COMFYUI_PATH.")
    return args


def main() -> None:
    config = sd35_medium_config()
    args = parse_args(config["num_layers"])
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    with tempfile.TemporaryDirectory() as tmp:
        nodes = comfy_env.import_comfy(args.comfyui, Path(tmp), cpu=args.device == "cpu", sdpa=True)
        from t5core.hosts.comfy import arch_of, converted_layers, linearize

        model = build_model(config, args.blocks, dtype)
        arch = arch_of(model)
        print(header_line())
        print(
            f"model: ComfyUI MMDiT, SD3.5 Medium config, {args.blocks} of {config['num_layers']} blocks, "
            f"{args.dtype}; one euler step, CFG batch 2, {TEXT_TOKENS} text tokens; softmax = SDPA"
        )
        print(f"{'size':>9} {'path':>6} {'modules':>8} {'median ms':>10} {'p20-p80 ms':>19} {'speedup':>10}")
        rows = []
        variants = {"softmax": model}
        for spec in args.specs:
            weights = write_t5_weights(
                Path(tmp) / f"{spec}.safetensors",
                arch,
                resolve_layers(spec, arch),
                seed=1,
                fast_weight_std=None,
                made_by="bench_comfy_step",
            )
            variants[spec] = linearize(model, weights)
        for size in args.sizes:
            steps = {name: one_step(nodes, patcher, config, size) for name, patcher in variants.items()}
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

"""Key bias of the toy teacher's attention: r = |mean k| / mean |k| per module, trained vs random init.

    python -m experiments.key_bias

The paper motivates its key normalisation with this ratio (about 0.5 in pretrained ViTs, 0.07 at
random initialisation): keys that share a large common direction are harmless in softmax, where the
shared part cancels, but dominate linear attention's state. For each attention module the image keys
are taken after the q/k RMSNorm, as attention sees them; per sample and head, r is the norm of the
mean key over tokens divided by the mean key norm, then averaged over samples and heads. Inputs are
fixed toy batches noised at sigma 0.25, 0.5 and 0.75, and pure noise (sigma 1), where the image
tokens share nothing but their captions: a toy image is mostly flat black background, whose patches
are one and the same latent vector, so noised images carry a common key direction from the data
alone, whatever the weights.
"""

from __future__ import annotations

import argparse
import logging

import torch
from torch import Tensor, nn

from benchmarks.timing import header_line, write_json
from experiments import RESULTS_DIR
from sd3_testbed.data import make_batch
from sd3_testbed.model import build_toy_model, load_toy_base
from trainer.losses import add_noise, predict_velocity

logger = logging.getLogger(__name__)

SIGMAS = (0.25, 0.5, 0.75)
PURE_NOISE = (1.0,)


def key_bias_ratio(keys: Tensor) -> float:
    """r for keys `(B, H, N, D)`: |mean over N| / mean over N of |k|, averaged over B and H."""
    mean_norm = keys.float().mean(2).norm(dim=-1)
    norm_mean = keys.float().norm(dim=-1).mean(2)
    return (mean_norm / norm_mean.clamp_min(1e-12)).mean().item()


def module_ratios(
    model: nn.Module, *, samples: int, sigmas: tuple[float, ...] = SIGMAS, seed: int = 0
) -> dict[str, float]:
    """r of every attention module's image keys (`blocks.{i}.attn` / `.attn2`), mean over `sigmas`."""
    captured: dict[str, list[float]] = {}
    hooks = []
    for name, module in model.named_modules():
        if name.endswith(("attn", "attn2")) and getattr(module, "norm_k", None) is not None:
            key = name.replace("transformer_blocks.", "blocks.")
            hooks.append(
                module.norm_k.register_forward_hook(
                    lambda _m, _a, out, key=key: captured.setdefault(key, []).append(key_bias_ratio(out))
                )
            )
    batch = make_batch(samples, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    noise = torch.randn(batch.latents.shape, generator=generator)
    try:
        with torch.no_grad():
            for sigma in sigmas:
                sigmas = torch.full((samples,), sigma)
                x_t = add_noise(batch.latents, noise, sigmas)
                predict_velocity(
                    model, x_t, sigmas, context=batch.encoder_hidden_states, pooled=batch.pooled_projections
                )
    finally:
        for hook in hooks:
            hook.remove()
    return {name: sum(values) / len(values) for name, values in captured.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--json", default="key_bias")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    models = {"trained": load_toy_base(), "random_init": build_toy_model(seed=0).eval()}
    columns = {
        f"{which}{suffix}": module_ratios(model, samples=args.samples, sigmas=sigmas)
        for suffix, sigmas in (("", SIGMAS), ("_pure_noise", PURE_NOISE))
        for which, model in models.items()
    }
    lines = [
        header_line(),
        f"key bias r = |mean k| / mean |k| of image keys after q/k norm, {args.samples} samples, noised toy "
        f"images (sigma {', '.join(map(str, SIGMAS))}) and pure noise (sigma 1)",
        "",
        "| module | teacher, noised images | random init, noised images | teacher, pure noise "
        "| random init, pure noise |",
        "|---|---|---|---|---|",
    ]
    order = ("trained", "random_init", "trained_pure_noise", "random_init_pure_noise")
    rows = []
    for name in columns["trained"]:
        lines.append(f"| {name} | " + " | ".join(f"{columns[c][name]:.3f}" for c in order) + " |")
        rows.append({"module": name, **{c: columns[c][name] for c in order}})
    means = [sum(columns[c].values()) / len(columns[c]) for c in order]
    lines.append("| mean | " + " | ".join(f"{m:.3f}" for m in means) + " |")
    table = "\n".join(lines)
    print(table)
    meta = {"samples": args.samples, "sigmas": list(SIGMAS), "pure_noise_sigmas": list(PURE_NOISE), "table": table}
    write_json(args.json, rows, meta=meta, directory=RESULTS_DIR)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Where a T5 toy model's artifacts come from: its samples' levels against the teacher's, and how much
of each converted module's output error against softmax is the same at every image token.

    python -m experiments.artifact_probe runs/toy/t5.safetensors          # 48 samples
    python -m experiments.artifact_probe FILE --count 180 --json artifact_probe_all_hybrid
    python -m experiments.artifact_probe FILE --cfg 1 --json artifact_probe_cfg1   # guidance off

Samples: the evaluation set's first `--count` captions and noise for the teacher and for the shipped
teacher converted with FILE (`t5core.hosts.diffusers.linearize`, torch backend); the background
level, the open-background level, the open background before the decoder's clamp (bias, noise, token
pattern: `sd3_testbed.artifacts.background_error`) and ToyEval of both.

Modules: while the T5 model samples, each converted module's T5 output on its image rows is compared
with softmax attention over the same q, k, v (what the module would compute unconverted, with its
fine-tuned projections). `rel err` = ||T5 - softmax|| / ||softmax||; `token-constant share` = the
share of that error's energy in its mean over the image tokens (per sample, head and channel): 1
means the error is one vector added to every image token, which decodes to a token-periodic pattern
and lifts flat regions; white error gives about 1 / image tokens. With guidance on (`--cfg` other than
1, cond and uncond in one batch), `caption response` = ||cond - uncond|| / ||cond|| of the image rows'
output, for T5 and for softmax over the same q, k, v: how much the module's output depends on the
caption, which is what classifier-free guidance amplifies.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from benchmarks.timing import header_line, write_json
from experiments import RESULTS_DIR
from sd3_testbed.artifacts import background_error, background_level, open_background_level, token_period_energy
from sd3_testbed.eval import toy_eval
from sd3_testbed.model import load_toy_base
from t5core.attention import T5Attention
from t5core.hosts.diffusers import linearize


@dataclass
class ErrorEnergy:
    """Running sums over one module's calls."""

    error: float = 0.0
    constant: float = 0.0
    reference: float = 0.0
    cond: dict[str, float] = field(default_factory=lambda: {"t5": 0.0, "softmax": 0.0})
    cond_minus_uncond: dict[str, float] = field(default_factory=lambda: {"t5": 0.0, "softmax": 0.0})

    def add(self, t5_out: Tensor, softmax_out: Tensor, *, guided: bool) -> None:
        error = (t5_out - softmax_out).float()  # (B, n, H, D)
        self.error += error.square().sum().item()
        self.constant += (error.mean(dim=1).square().sum() * error.shape[1]).item()
        self.reference += softmax_out.float().square().sum().item()
        if guided:  # cond rows first, then uncond (sd3_testbed.model.sample)
            for name, out in (("t5", t5_out), ("softmax", softmax_out)):
                cond, uncond = out.float().chunk(2)
                self.cond[name] += cond.square().sum().item()
                self.cond_minus_uncond[name] += (cond - uncond).square().sum().item()

    def caption_response(self, name: str) -> float | None:
        """||cond - uncond|| / ||cond|| of `name`'s output ("t5" or "softmax"); None without guidance."""
        return (self.cond_minus_uncond[name] / self.cond[name]) ** 0.5 if self.cond[name] else None


def _image_rows(x: Tensor, kwargs: dict) -> Tensor:
    grid, text, first = kwargs["grid"], kwargs.get("text_tokens", 0), kwargs.get("text_first", True)
    n = grid[0] * grid[1]
    return x[:, text : text + n] if first and text else x[:, :n]


def _recorder(energy: ErrorEnergy, *, guided: bool) -> Callable[[nn.Module, tuple, dict, Tensor], None]:
    def hook(module: nn.Module, args: tuple, kwargs: dict, output: Tensor) -> None:
        q, k, v = args
        softmax_out = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v))).transpose(1, 2)
        energy.add(_image_rows(output, kwargs), _image_rows(softmax_out, kwargs), guided=guided)

    return hook


def _response(t5: float | None, softmax: float | None) -> str:
    return "- (no guidance)" if t5 is None or softmax is None else f"{t5:.3f} ({softmax:.3f})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("weights", help="a T5 weights file for the toy (python trainer/run.py writes one)")
    parser.add_argument("--count", type=int, default=48, help="evaluation samples")
    parser.add_argument("--cfg", type=float, default=3.0, help="guidance scale of both models (1 = off)")
    parser.add_argument("--json", default="artifact_probe", help="name of the JSON file under experiments/results/")
    args = parser.parse_args(argv)

    with torch.no_grad():
        teacher_score, teacher_raw = toy_eval(load_toy_base(), count=args.count, cfg=args.cfg, clamp=False)
        model = load_toy_base()
        linearize(model, weights=args.weights, backend="torch")
        energies = {}
        for name, module in model.named_modules():
            if isinstance(module, T5Attention):
                energies[name.removesuffix(".processor.t5")] = energy = ErrorEnergy()
                module.register_forward_hook(_recorder(energy, guided=args.cfg != 1.0), with_kwargs=True)
        score, raw = toy_eval(model, count=args.count, cfg=args.cfg, clamp=False)
    teacher_images, images = teacher_raw.clamp(0.0, 1.0), raw.clamp(0.0, 1.0)
    errors = {"T5": background_error(raw, teacher_images), "teacher": background_error(teacher_raw, teacher_images)}

    samples = {
        "toyeval": score.overall,
        "teacher_toyeval": teacher_score.overall,
        "background": background_level(images, teacher_images),
        "teacher_background": background_level(teacher_images, teacher_images),
        "open_background": open_background_level(images, teacher_images),
        "teacher_open_background": open_background_level(teacher_images, teacher_images),
        "token_period_energy": token_period_energy(images, teacher_images),
        "background_error": asdict(errors["T5"]),
        "teacher_background_error": asdict(errors["teacher"]),
    }
    modules = [
        {
            "module": name,
            "rel_err": (e.error / e.reference) ** 0.5,
            "token_constant_share": e.constant / e.error,
            "caption_response": e.caption_response("t5"),
            "softmax_caption_response": e.caption_response("softmax"),
        }
        for name, e in energies.items()
    ]
    lines = [
        header_line(),
        f"artifact probe of {args.weights}: {args.count} evaluation samples against the teacher's, cfg {args.cfg:g}",
        "",
        "| ToyEval (teacher) | background (teacher) | open background (teacher) | token-period energy |",
        "|---|---|---|---|",
        f"| {samples['toyeval']:.3f} ({samples['teacher_toyeval']:.3f}) | {samples['background']:.4f} "
        f"({samples['teacher_background']:.5f}) | {samples['open_background']:.4f} "
        f"({samples['teacher_open_background']:.5f}) | {samples['token_period_energy']:.4f} |",
        "",
        "open background before the decoder's clamp (the data's is 0):",
        "",
        "| samples of | bias | noise | token pattern | share above black |",
        "|---|---|---|---|---|",
        *(
            f"| {name} | {e.bias:+.4f} | {e.noise:.4f} | {e.token_pattern:.4f} | {e.lit:.2f} |"
            for name, e in errors.items()
        ),
        "",
        "| converted module | rel err vs softmax | token-constant share of the error | caption response T5 (softmax) |",
        "|---|---|---|---|",
        *(
            f"| {m['module']} | {m['rel_err']:.3f} | {m['token_constant_share']:.3f} | "
            f"{_response(m['caption_response'], m['softmax_caption_response'])} |"
            for m in modules
        ),
    ]
    table = "\n".join(lines)
    print(table)
    meta = {"weights": str(args.weights), "count": args.count, "cfg": args.cfg, **samples, "table": table}
    write_json(args.json, modules, meta=meta, directory=RESULTS_DIR)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

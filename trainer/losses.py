"""Losses of the conversion fine-tune: SD3 flow matching, output distillation, attention alignment.

Flow matching (SD3, rectified flow): sigma = shift*s / (1 + (shift-1)*s) with s ~ logit-normal(m, std);
x_t = (1 - sigma) x0 + sigma eps; the model predicts the velocity eps - x0 at timestep 1000*sigma.
Distillation is the MSE between the student's and the frozen softmax teacher's velocity on the same
x_t; alignment is the MSE between each converted module's attention output and the teacher's output
of the same module, averaged over modules. Every term is reported; the total is their weighted sum.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from trainer.config import LossConfig

__all__ = [
    "AttentionCapture",
    "LossTerms",
    "add_noise",
    "combine",
    "flow_weights",
    "predict_velocity",
    "sample_sigmas",
    "shift_sigmas",
    "step_losses",
]


def shift_sigmas(s: Tensor, shift: float) -> Tensor:
    """SD3's timestep shift, sigma = shift*s / (1 + (shift-1)*s): what training sigmas and sampling
    schedules (`trainer.sampling.sigma_schedule`) go through; shift 1 is the identity."""
    return shift * s / (1 + (shift - 1) * s)


def sample_sigmas(count: int, *, generator: torch.Generator, config: LossConfig) -> Tensor:
    """`(count,)` training sigmas: logit-normal(logit_mean, logit_std) pushed through the shift map."""
    s = torch.sigmoid(config.logit_mean + config.logit_std * torch.randn(count, generator=generator))
    return shift_sigmas(s, config.shift)


def add_noise(x0: Tensor, noise: Tensor, sigmas: Tensor) -> Tensor:
    """x_t = (1 - sigma) x0 + sigma eps, per sample."""
    s = sigmas.view(-1, *([1] * (x0.dim() - 1)))
    return (1 - s) * x0 + s * noise


def predict_velocity(model: nn.Module, x_t: Tensor, sigmas: Tensor, *, context: Tensor, pooled: Tensor) -> Tensor:
    """The model's velocity at `x_t`, timestep `1000 * sigma`, inputs cast to the model's dtype.

    Args:
        model: an SD3-family transformer with the diffusers call (softmax or linearized).
        x_t (`Tensor`): noisy latents `(B, C, h, w)`. sigmas: `(B,)`.
        context (`Tensor`): `(B, T, J)` text tokens. pooled: `(B, P)`.
    """
    dtype = next(model.parameters()).dtype
    return model(
        hidden_states=x_t.to(dtype),
        encoder_hidden_states=context.to(dtype),
        pooled_projections=pooled.to(dtype),
        timestep=(sigmas * 1000).to(dtype),
        return_dict=False,
    )[0]


def flow_weights(sigmas: Tensor, scheme: str) -> Tensor:
    """Per-sample weights of the flow-matching MSE (diffusers' SD3 schemes)."""
    if scheme == "sigma_sqrt":
        return sigmas.float().pow(-2.0)
    if scheme == "cosmap":
        return 2 / (math.pi * (1 - 2 * sigmas + 2 * sigmas**2))
    return torch.ones_like(sigmas)


def _per_sample_mse(a: Tensor, b: Tensor) -> Tensor:
    return (a.float() - b.float()).square().flatten(1).mean(1)


@dataclass(frozen=True, slots=True)
class LossTerms:
    """The total loss (differentiable) and each unweighted term as a detached scalar."""

    total: Tensor
    terms: dict[str, Tensor]


def combine(
    config: LossConfig,
    *,
    prediction: Tensor,
    target: Tensor,
    sigmas: Tensor,
    teacher_prediction: Tensor | None = None,
    features: list[tuple[Tensor, Tensor]] | None = None,
) -> LossTerms:
    """Weighted sum of the configured losses over a batch.

    Args:
        prediction, target (`Tensor`): student velocity and eps - x0, `(B, C, h, w)`.
        sigmas (`Tensor`): `(B,)` the batch's sigmas (for the flow weighting).
        teacher_prediction (`Tensor`, *optional*): the teacher's velocity; needed when distill_weight > 0.
        features (`list`, *optional*): (student, teacher) attention outputs per converted module;
            needed when feature_weight > 0.
    """
    terms: dict[str, Tensor] = {}
    if config.flow_weight > 0:
        weights = flow_weights(sigmas, config.weighting).to(prediction.device)
        terms["flow"] = (weights * _per_sample_mse(prediction, target)).mean()
    if config.distill_weight > 0:
        if teacher_prediction is None:
            raise ValueError("distill_weight > 0 needs the teacher's prediction.")
        terms["distill"] = F.mse_loss(prediction.float(), teacher_prediction.float())
    if config.feature_weight > 0:
        if not features:
            raise ValueError("feature_weight > 0 needs the attention outputs of the converted modules.")
        terms["feature"] = torch.stack([F.mse_loss(s.float(), t.float()) for s, t in features]).mean()
    total = prediction.new_zeros((), dtype=torch.float32)
    for name, term in terms.items():
        total = total + getattr(config, f"{name}_weight") * term
    return LossTerms(total, {name: term.detach() for name, term in terms.items()})


class AttentionCapture:
    """Records the outputs of named attention modules during one forward pass.

    Hooks stay installed but record only inside `recording()`, so the recompute of gradient
    checkpointing (which runs the modules again during backward) is ignored. Image and text outputs
    of joint attention are concatenated along tokens.
    """

    def __init__(self, model: nn.Module, module_names: list[str]) -> None:
        modules = dict(model.named_modules())
        missing = [name for name in module_names if name not in modules]
        if missing:
            raise ValueError(f"no attention module named {missing} in {type(model).__name__}.")
        self.names = list(module_names)
        self.outputs: dict[str, Tensor] = {}
        self._recording = False
        self._hooks = [modules[name].register_forward_hook(self._hook(name)) for name in self.names]

    def _hook(self, name: str):
        def hook(module: nn.Module, args: tuple, output: Tensor | tuple) -> None:
            if not self._recording:
                return
            parts = output if isinstance(output, tuple) else (output,)
            self.outputs[name] = torch.cat([p for p in parts if p is not None], dim=1)

        return hook

    @contextlib.contextmanager
    def recording(self) -> Iterator[dict[str, Tensor]]:
        self.outputs = {}
        self._recording = True
        try:
            yield self.outputs
        finally:
            self._recording = False

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()


def _recording(capture: AttentionCapture | None) -> AbstractContextManager[dict[str, Tensor]]:
    return contextlib.nullcontext({}) if capture is None else capture.recording()


def step_losses(
    model: nn.Module,
    latents: Tensor,
    *,
    noise: Tensor,
    sigmas: Tensor,
    context: Tensor,
    pooled: Tensor,
    config: LossConfig,
    teacher: nn.Module | None = None,
    captures: tuple[AttentionCapture, AttentionCapture] | None = None,
) -> LossTerms:
    """One batch's losses: noise `latents` `(B, C, h, w)`, predict with the student and, when given, the frozen
    teacher (no gradients), `combine`; `captures` (student, teacher) record the outputs the alignment loss reads."""
    x_t = add_noise(latents, noise, sigmas)
    teacher_prediction, teacher_out = None, {}
    if teacher is not None:
        with torch.no_grad(), _recording(captures and captures[1]) as teacher_out:
            teacher_prediction = predict_velocity(teacher, x_t, sigmas, context=context, pooled=pooled)
    with _recording(captures and captures[0]) as student_out:
        prediction = predict_velocity(model, x_t, sigmas, context=context, pooled=pooled)
    features = None if captures is None else [(student_out[name], teacher_out[name]) for name in captures[0].names]
    return combine(
        config,
        prediction=prediction,
        target=noise - latents,
        sigmas=sigmas,
        teacher_prediction=teacher_prediction,
        features=features,
    )

"""Flow-matching sigmas and loss terms, and attention capture under gradient checkpointing."""

from __future__ import annotations

import pytest
import torch

from testing.trainer_assets import trainer_transformer
from trainer.config import LossConfig
from trainer.losses import AttentionCapture, add_noise, combine, flow_weights, sample_sigmas


@pytest.mark.parametrize("shift", [pytest.param(1.0, id="shift1"), pytest.param(3.0, id="shift3")])
def test_sigmas_are_shifted_logit_normal(shift):
    config = LossConfig(shift=shift, logit_mean=0.2, logit_std=0.7)
    sigmas = sample_sigmas(1000, generator=torch.Generator().manual_seed(0), config=config)
    s = torch.sigmoid(0.2 + 0.7 * torch.randn(1000, generator=torch.Generator().manual_seed(0)))
    torch.testing.assert_close(sigmas, shift * s / (1 + (shift - 1) * s))
    assert 0 < sigmas.min() and sigmas.max() < 1


def test_higher_shift_means_more_noise():
    generator = lambda: torch.Generator().manual_seed(1)  # noqa: E731
    low = sample_sigmas(500, generator=generator(), config=LossConfig(shift=1.0))
    high = sample_sigmas(500, generator=generator(), config=LossConfig(shift=3.0))
    assert bool((high >= low).all()) and high.mean() > low.mean() + 0.1


def test_flow_loss_is_zero_for_the_true_velocity_and_weights_add_up():
    x0, noise = torch.randn(3, 16, 4, 6), torch.randn(3, 16, 4, 6)
    sigmas = torch.tensor([0.2, 0.5, 0.9])
    x_t = add_noise(x0, noise, sigmas)
    torch.testing.assert_close(x_t[1], 0.5 * x0[1] + 0.5 * noise[1])
    target = noise - x0
    exact = combine(LossConfig(), prediction=target, target=target, sigmas=sigmas)
    assert exact.terms["flow"].item() == 0.0
    prediction = target + 0.1
    teacher = target - 0.1
    config = LossConfig(flow_weight=1.0, distill_weight=0.5)
    terms = combine(config, prediction=prediction, target=target, sigmas=sigmas, teacher_prediction=teacher)
    torch.testing.assert_close(terms.terms["flow"], torch.tensor(0.01))
    torch.testing.assert_close(terms.terms["distill"], torch.tensor(0.04))
    torch.testing.assert_close(terms.total, torch.tensor(0.01 + 0.5 * 0.04))


def test_weighting_schemes():
    sigmas = torch.tensor([0.25, 0.5])
    torch.testing.assert_close(flow_weights(sigmas, "sigma_sqrt"), torch.tensor([16.0, 4.0]))
    torch.testing.assert_close(flow_weights(sigmas, "none"), torch.ones(2))
    assert flow_weights(torch.tensor([0.5]), "cosmap").item() == pytest.approx(2 / (torch.pi * 0.5))


def test_distill_without_teacher_is_an_error():
    t = torch.zeros(1, 16, 2, 2)
    with pytest.raises(ValueError, match="distill_weight > 0 needs the teacher's prediction"):
        combine(LossConfig(distill_weight=1.0), prediction=t, target=t, sigmas=torch.ones(1) / 2)


def test_capture_ignores_the_checkpoint_recompute():
    model = trainer_transformer()
    model.enable_gradient_checkpointing()
    model.train()
    capture = AttentionCapture(model, ["transformer_blocks.0.attn", "transformer_blocks.0.attn2"])
    inputs = dict(
        hidden_states=torch.randn(1, 16, 8, 12),
        encoder_hidden_states=torch.randn(1, 7, 32),
        pooled_projections=torch.randn(1, 64),
        timestep=torch.tensor([500.0]),
    )
    with capture.recording() as outputs:
        out = model(**inputs, return_dict=False)[0]
    recorded = dict(outputs)
    assert recorded["transformer_blocks.0.attn"].shape == (1, 4 * 6 + 7, 32)  # image then text tokens
    assert recorded["transformer_blocks.0.attn2"].shape == (1, 4 * 6, 32)
    out.square().mean().backward()  # recompute runs the attention modules again
    assert outputs.keys() == recorded.keys()
    assert all(outputs[k] is recorded[k] for k in recorded)
    capture.remove()

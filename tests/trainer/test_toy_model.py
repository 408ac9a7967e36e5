"""The shipped toy teacher: SD3 naming that ComfyUI detects, loads in diffusers both ways,
reproduces its recorded ToyEval; the sampler runs with and without T5."""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch
from safetensors import safe_open

from sd3_testbed.data import make_batch
from sd3_testbed.eval import eval_set, generate, sample_hits
from sd3_testbed.model import (
    TOY_CONFIG,
    WEIGHTS_DIR,
    WEIGHTS_FILE,
    ToyCond,
    build_toy_model,
    load_toy_base,
    load_toy_record,
)
from sd3_testbed.pretrain import PretrainConfig
from sd3_testbed.reference import samples_file
from trainer.sampling import sample, sigma_schedule

REPRO_SAMPLES = 24


@pytest.fixture(scope="module")
def teacher():
    return load_toy_base()


def test_shipped_file_is_small_and_comfyui_detectable():
    assert WEIGHTS_FILE.stat().st_size < 20 * 2**20
    with safe_open(str(WEIGHTS_FILE), "pt") as handle:
        keys = set(handle.keys())
        embedder = handle.get_slice("x_embedder.proj.weight").get_shape()
        pos_embed = handle.get_slice("pos_embed").get_shape()
    depth = TOY_CONFIG["num_layers"]
    # What ComfyUI's model_detection reads: depth = x_embedder rows // 64, patch 2, 16 channels.
    assert embedder == [64 * depth, 16, 2, 2]
    assert pos_embed == [1, TOY_CONFIG["pos_embed_max_size"] ** 2, 64 * depth]
    for key in (
        "joint_blocks.0.context_block.attn.qkv.weight",
        "joint_blocks.0.context_block.attn.ln_q.weight",
        "context_embedder.weight",
        "y_embedder.mlp.0.weight",
        "final_layer.linear.weight",
    ):
        assert key in keys, key
    attn2 = sorted(int(k.split(".")[1]) for k in keys if k.endswith(".x_block.attn2.qkv.weight"))
    assert attn2 == list(TOY_CONFIG["dual_attention_layers"])
    assert not any(k.startswith("transformer_blocks.") for k in keys)


def test_diffusers_single_file_loader_agrees_with_our_key_map(teacher):
    from diffusers import SD3Transformer2DModel

    loaded = SD3Transformer2DModel.from_single_file(
        str(WEIGHTS_FILE), config=str(WEIGHTS_DIR), local_files_only=True, torch_dtype=torch.float32
    )
    ours, theirs = teacher.state_dict(), loaded.state_dict()
    assert ours.keys() == theirs.keys()
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name


def test_record_is_of_the_pretrain_scripts_default_recipe():
    # `python -m sd3_testbed.pretrain` with no arguments remakes the shipped teacher.
    assert load_toy_record()["recipe"] == asdict(PretrainConfig())


@pytest.fixture(scope="module")
def teacher_hits(teacher):
    """Whether each of the first REPRO_SAMPLES ToyEval samples passes, sampled from the teacher now
    with the recorded settings."""
    settings = load_toy_record()["toyeval_settings"]
    captions, noise = eval_set(REPRO_SAMPLES, seed=settings["seed"])
    images = generate(teacher, captions, noise, steps=settings["steps"], cfg=settings["cfg"])
    return [int(h["overall"]) for h in sample_hits(images, captions)]


def test_teacher_is_a_discriminating_benchmark(teacher_hits):
    # Neither saturated nor weak: a teacher on which every model scores alike proves nothing. Chance
    # is 1/180 (one caption of 180); the teacher passes 15 of these 24 (0.706 over all 180), and the
    # bounds leave room for the 2 flips another machine's summation order may cause.
    assert 10 <= sum(teacher_hits) <= 21, teacher_hits


def test_teacher_reproduces_recorded_toyeval(teacher_hits):
    record = load_toy_record()
    recorded = record["per_sample_overall"][:REPRO_SAMPLES]
    # Same noise and prompts; only float summation order differs between machines, which can
    # flip a borderline sample. Allow 2 of 24 flips, and the prefix must be near the full score.
    assert sum(a != b for a, b in zip(teacher_hits, recorded, strict=True)) <= 2, (teacher_hits, recorded)
    assert abs(sum(teacher_hits) / REPRO_SAMPLES - record["toyeval"]["overall"]) <= 0.25


def test_sigma_schedule_endpoints_and_shift():
    plain = sigma_schedule(4, shift=1.0)
    torch.testing.assert_close(plain, torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0]))
    shifted = sigma_schedule(4, shift=3.0)
    assert shifted[0] == 1 and shifted[-1] == 0 and bool((shifted[1:-1] > plain[1:-1]).all())
    with pytest.raises(ValueError, match="at least 1"):
        sigma_schedule(0)


def test_one_euler_step_matches_the_flow_matching_update(teacher):
    texts = ["small red circle top left", "large cyan triangle center"]
    cond = ToyCond.from_captions(texts)
    noise = torch.randn(2, 16, 8, 12, generator=torch.Generator().manual_seed(0))
    out = sample(teacher, cond, noise, steps=1, cfg=2.5, shift=1.0)
    timestep = torch.full((4,), 1000.0)
    with torch.no_grad():
        v = teacher(
            hidden_states=torch.cat([noise, noise]),
            encoder_hidden_states=torch.cat([cond.context, cond.context_uncond]),
            pooled_projections=torch.cat([cond.pooled, cond.pooled_uncond]),
            timestep=timestep,
            return_dict=False,
        )[0]
    v_cond, v_uncond = v.chunk(2)
    torch.testing.assert_close(out, noise - (v_uncond + 2.5 * (v_cond - v_uncond)), rtol=1e-5, atol=1e-5)


def test_sampler_runs_linearized_and_undo_restores(teacher):
    from t5core.hosts.diffusers import linearize

    batch = make_batch(2, seed=0)
    cond = ToyCond.from_captions([str(c) for c in batch.captions])
    noise = torch.randn(2, 16, 8, 12, generator=torch.Generator().manual_seed(1))
    before = sample(teacher, cond, noise, steps=2)
    handle = linearize(teacher, layers="paper", backend="torch", inplace=True)
    try:
        converted = sample(teacher, cond, noise, steps=2)
    finally:
        handle.remove()
    assert torch.isfinite(converted).all() and converted.shape == noise.shape
    assert not torch.allclose(converted, before)
    assert torch.equal(sample(teacher, cond, noise, steps=2), before)


def test_sample_rejects_batch_mismatch(teacher):
    with pytest.raises(ValueError, match="one caption per sample"):
        sample(teacher, ToyCond.from_captions(["small red circle center"]), torch.randn(2, 16, 8, 8), steps=1)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        pytest.param(["--lr", "0"], "--lr must be positive; got 0.0", id="lr"),
        pytest.param(["--warmup", "-1"], "--warmup must not be negative; got -1", id="warmup"),
        pytest.param(["--eval-count", "0"], "--eval-count must be at least 1; got 0", id="eval-count"),
        pytest.param(["--drop-text", "1"], "--drop-text must be in [0, 1); got 1.0", id="drop-text"),
    ],
)
def test_pretrain_refuses_a_bad_flag_before_training(tmp_path, capsys, flags, message):
    """Named by the script's own flag (not the trainer's --optim.*), before the 30-minute training and
    before anything is written (the weights file included)."""
    from sd3_testbed.pretrain import main

    with pytest.raises(SystemExit) as exit_info:
        main([*flags, "--out", str(tmp_path / "teacher.safetensors")])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_the_teacher_record_draws_its_evaluation_set_once(tmp_path, monkeypatch):
    from sd3_testbed import eval as toy_eval_module
    from sd3_testbed import pretrain

    drawn = []

    def counted(count, **kwargs):
        drawn.append((count, kwargs))
        return eval_set(count, **kwargs)

    monkeypatch.setattr(toy_eval_module, "eval_set", counted)
    monkeypatch.setattr(pretrain, "eval_set", counted)
    cfg = PretrainConfig(eval_count=3, eval_steps=1)
    path = pretrain.export_teacher(build_toy_model(seed=0), tmp_path / "teacher.safetensors", cfg)
    record = pretrain.record_teacher(path, cfg, train_seconds=1.0, final_loss=0.5)
    settings = record["toyeval_settings"]
    assert drawn == [(3, {"seed": settings["seed"], "size": settings["size"]})]
    assert samples_file(path).is_file()  # the samples a run's evaluation reuses
    assert record["toyeval"]["overall"] == sum(record["per_sample_overall"]) / 3

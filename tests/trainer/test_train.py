"""End-to-end runs of `trainer.run` in one process on the tiny SD3.5-Medium-like model."""

from __future__ import annotations

import json

import pytest
import torch

from t5core.hosts.diffusers import linearize
from testing.trainer_assets import RECIPE_FLAGS, write_base, write_cache
from trainer.cli import parse_args
from trainer.losses import add_noise
from trainer.metrics import read_metrics
from trainer.model import build_student, load_base
from trainer.seeds import seed_everything
from trainer.train import run


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    return dict(
        base=write_base(root / "base"),
        cache=write_cache(root / "cache", buckets=((8, 12), (12, 8)), per_bucket=4),
        fixed=write_cache(root / "fixed", buckets=((8, 12),), per_bucket=4),
    )


def config_for(inputs, out, *flags, data="cache"):
    return parse_args(
        [
            "--model.base", str(inputs["base"]),
            "--data.source", "cache",
            "--data.path", str(inputs[data]),
            "--model.layers", "all",
            "--training.batch_size", "4",
            "--output.dir", str(out),
            "--output.progress", "false",
            *RECIPE_FLAGS,
            *flags,
        ]
    )  # fmt: skip


def initial_student(config):
    """The converted model as the trainer builds it before the first step (same seed, same recipe)."""
    seed_everything(config.training.seed)
    return build_student(load_base(config.model), config.model).model


def flow_loss(model, batch_latents, context, pooled, noise, sigmas):
    with torch.no_grad():
        x_t = add_noise(batch_latents, noise, sigmas)
        out = model(
            hidden_states=x_t,
            encoder_hidden_states=context,
            pooled_projections=pooled,
            timestep=sigmas * 1000,
            return_dict=False,
        )[0]
    return (out - (noise - batch_latents)).square().mean().item()


def test_steps_on_a_fixed_batch_lower_the_loss(inputs, tmp_path):
    config = config_for(
        inputs, tmp_path, "--training.steps", "8", "--optim.lr", "3e-3", "--optim.inherited_lr_mult", "1",
        "--model.trainable", "all", "--checkpoint.every", "0", data="fixed",
    )  # fmt: skip
    before = initial_student(config)
    result = run(config)
    from trainer.inputs.cache import CacheSource

    batch = CacheSource(inputs["fixed"]).load([0, 1, 2, 3])
    generator = torch.Generator().manual_seed(5)
    noise, sigmas = torch.randn(batch.latents.shape, generator=generator), torch.tensor([0.3, 0.5, 0.7, 0.9])
    args = (batch.latents, batch.context, batch.pooled, noise, sigmas)
    start, end = flow_loss(before.eval(), *args), flow_loss(result.handle.model.eval(), *args)
    # Eight steps on random latents: a clear drop, not convergence.
    assert end < 0.9 * start, (start, end)
    metrics = read_metrics(tmp_path / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, 9))
    assert {"loss/total", "loss/flow", "lr/new", "lr/inherited", "grad_norm", "throughput(img/s)"} <= metrics[0].keys()
    assert (tmp_path / "config.toml").is_file() and (tmp_path / "report.md").is_file()
    assert json.loads((tmp_path / "report.json").read_text())["step"] == 8


@pytest.mark.parametrize(
    ("trainable", "inherited_mult"),
    [pytest.param("attention", 0.1, id="attention-x0.1"), pytest.param("attention", 0.0, id="inherited-frozen-by-lr0")],
)
def test_each_group_moves_with_its_own_learning_rate(inputs, tmp_path, trainable, inherited_mult):
    lr = 1e-3
    config = config_for(
        inputs, tmp_path, "--training.steps", "1", "--optim.lr", str(lr), "--optim.grad_clip", "0",
        "--optim.inherited_lr_mult", str(inherited_mult), "--model.trainable", trainable,
        "--model.layers", "blocks.0.attn2",
    )  # fmt: skip
    before = {name: p.detach().clone() for name, p in initial_student(config).named_parameters()}
    result = run(config)
    after = dict(result.handle.model.named_parameters())
    moved = {name: (after[name].detach() - before[name]).abs().max().item() for name in before}
    new = [n for n in moved if ".processor." in n]
    inherited = [n for n in moved if n.startswith("transformer_blocks.0.attn2.") and ".processor." not in n]
    frozen = [n for n in moved if n not in new and n not in inherited]
    assert new and inherited and frozen
    # The first AdamW step moves each weight by lr * g / (|g| + eps): lr wherever the gradient is not tiny.
    assert max(moved[n] for n in new) == pytest.approx(lr * config.optim.new_lr_mult, rel=1e-3)
    if inherited_mult:
        assert max(moved[n] for n in inherited) == pytest.approx(lr * inherited_mult, rel=1e-3)
    else:
        assert max(moved[n] for n in inherited) == 0.0
    assert max(moved[n] for n in frozen) == 0.0


@pytest.mark.parametrize(
    "mode",
    [
        pytest.param(["--model.layers", "paper", "--model.joint_mode", "ttt"], id="paper"),
        pytest.param(
            ["--model.layers", "all", "--model.joint_mode", "hybrid", "--model.neighborhood", "5"], id="all-hybrid-na"
        ),
    ],
)
def test_exported_file_reproduces_the_trained_model(inputs, tmp_path, mode):
    config = config_for(inputs, tmp_path, "--training.steps", "2", *mode, "--optim.lr", "1e-2")
    result = run(config)
    fresh = linearize(load_base(config.model), weights=result.weights)
    assert set(fresh.modules) == set(result.handle.modules)
    assert fresh.config == result.handle.config  # the mode travels in the file
    generator = torch.Generator().manual_seed(0)
    kwargs = dict(
        hidden_states=torch.randn(2, 16, 12, 8, generator=generator),
        encoder_hidden_states=torch.randn(2, 7, 32, generator=generator),
        pooled_projections=torch.randn(2, 64, generator=generator),
        timestep=torch.tensor([100.0, 800.0]),
        return_dict=False,
    )
    with torch.no_grad():
        trained = result.handle.model.eval()(**kwargs)[0]
        loaded = fresh.model.eval()(**kwargs)[0]
        untouched = load_base(config.model)(**kwargs)[0]
    torch.testing.assert_close(loaded, trained, rtol=0, atol=1e-6)
    assert (loaded - untouched).abs().max() > 1e-3  # the file changes the model


def test_deltas_are_exported_in_the_base_precision_unless_fp32_is_asked(inputs, tmp_path):
    """`--output.base_dtype base` (the default) stores the deltas of inherited weights in the base
    checkpoint's precision (float16 here: half the bytes), `fp32` as trained; T5 parameters stay float32
    either way. Same seed, so the float16 tensors are the float32 ones rounded, and both files load into
    the base and run alike."""
    from safetensors import safe_open

    from testing.trainer_assets import trainer_transformer

    half = tmp_path / "base_fp16"
    trainer_transformer().to(torch.float16).save_pretrained(half)
    files, provenance, outputs = {}, {}, {}
    generator = torch.Generator().manual_seed(0)
    kwargs = dict(
        hidden_states=torch.randn(1, 16, 8, 12, generator=generator),
        encoder_hidden_states=torch.randn(1, 7, 32, generator=generator),
        pooled_projections=torch.randn(1, 64, generator=generator),
        timestep=torch.tensor([500.0]),
        return_dict=False,
    )
    for choice in ("base", "fp32"):
        config = config_for(
            {**inputs, "base": half}, tmp_path / choice, "--training.steps", "1", "--output.base_dtype", choice
        )
        weights = run(config).weights
        with safe_open(str(weights), "pt") as handle:
            files[choice] = {key: handle.get_tensor(key) for key in handle.keys()}
            provenance[choice] = json.loads(handle.metadata()["t5.trainer"])["delta_dtype"]
        with torch.no_grad():
            outputs[choice] = linearize(load_base(config.model), weights=weights).model.eval()(**kwargs)[0]
    assert provenance == {"base": "float16", "fp32": "float32"}
    delta_keys = [key for key in files["base"] if key.startswith("delta.")]
    assert delta_keys and files["base"].keys() == files["fp32"].keys()
    for key, tensor in files["base"].items():
        assert tensor.dtype == (torch.float16 if key in delta_keys else torch.float32), key
        assert files["fp32"][key].dtype == torch.float32
        assert torch.equal(tensor, files["fp32"][key].to(tensor.dtype)), key
    # float16 keeps 11 significant bits of each delta
    assert (outputs["base"] - outputs["fp32"]).abs().max() < 1e-2 * outputs["fp32"].abs().max()


def test_time_budget_stops_checkpoints_and_exports(inputs, tmp_path):
    config = config_for(
        inputs, tmp_path, "--training.steps", "50", "--training.max_minutes", "1e-6", "--output.log_every", "10"
    )
    result = run(config)
    assert (result.step, result.stop_reason) == (1, "time")
    assert [row["step"] for row in read_metrics(tmp_path / "metrics.jsonl")] == [1]  # the last step is logged
    assert (tmp_path / "checkpoints" / "step-1" / "state.json").is_file()
    assert result.weights.is_file()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_toy_source_trains_and_evaluates_the_toy_base(tmp_path, precision):
    """Under bf16 the frozen weights are held in bf16; ToyEval samples an fp32 copy (it crashed on the
    dtype mismatch), and the run's model keeps its weights as trained."""
    config = parse_args(
        [
            "--training.steps", "1", "--training.batch_size", "2", "--output.dir", str(tmp_path),
            "--output.progress", "false", "--output.toy_eval_samples", "4", "--training.precision", precision,
        ]
    )  # fmt: skip
    result = run(config)
    dtypes = {parameter.dtype for parameter in result.handle.model.parameters() if not parameter.requires_grad}
    assert dtypes == ({torch.bfloat16} if precision == "bf16" else {torch.float32})
    assert result.step == 1 and result.weights.is_file()
    assert result.handle.modules.keys() == {f"blocks.{i}.attn" for i in range(4)} | {"blocks.0.attn2", "blocks.1.attn2"}
    assert result.handle.config.joint_mode == "hybrid"  # the default: full linear time
    report = json.loads((tmp_path / "report.json").read_text())
    assert set(report["toy_eval"]) >= {"teacher", "student", "teacher_distance"}
    assert (tmp_path / "grid.png").is_file() and "ToyEval overall" in (tmp_path / "toy_eval.md").read_text()


def test_distillation_from_an_identical_teacher_is_exactly_zero(inputs, tmp_path):
    # Nothing converted: the student is the teacher's twin, so their outputs agree to the bit.
    config = config_for(
        inputs, tmp_path, "--training.steps", "1", "--model.layers", "none", "--model.trainable", "all",
        "--loss.distill_weight", "1",
    )  # fmt: skip
    run(config)
    assert read_metrics(tmp_path / "metrics.jsonl")[0]["loss/distill"] == 0.0


def test_distillation_and_alignment_terms_are_logged(inputs, tmp_path):
    config = config_for(
        inputs, tmp_path, "--training.steps", "2", "--loss.distill_weight", "0.5", "--loss.feature_weight", "0.5",
        "--training.gradient_checkpointing", "true", "--training.precision", "bf16",
    )  # fmt: skip
    run(config)
    first = read_metrics(tmp_path / "metrics.jsonl")[0]
    assert first["loss/distill"] > 0 and first["loss/feature"] > 0
    expected = first["loss/flow"] + 0.5 * first["loss/distill"] + 0.5 * first["loss/feature"]
    assert first["loss/total"] == pytest.approx(expected, rel=1e-5)


def test_nothing_to_train_is_an_error(inputs, tmp_path):
    with pytest.raises(ValueError, match=r"nothing would train: --model.layers 'none'"):
        run(config_for(inputs, tmp_path, "--model.layers", "none", "--model.trainable", "attention"))

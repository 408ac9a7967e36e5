"""Gradient accumulation (`--training.accumulate`): a step's global batch in micro-batches trains to the
weights and logs the losses of the whole batch at once, in the fine-tune and the attention transfer; the
reduction over ranks waits for the last micro-batch; memory is planned for a micro-batch and time for the
whole batch; settings that cannot split are refused. Two processes: tests/trainer/test_distributed.py."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from testing.trainer_assets import cache_run_flags, write_base, write_cache
from trainer.cli import parse_args
from trainer.config import ParallelConfig
from trainer.data import BatchPlan
from trainer.distributed import init_world
from trainer.inputs.cache import CacheSource
from trainer.metrics import read_metrics
from trainer.model import build_model, load_base
from trainer.parallelize import apply_ddp, gradient_sync
from trainer.planning.memory import plan_run
from trainer.train import run

LOGGED = ("loss/total", "loss/flow", "grad_norm", "transfer/loss")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("accumulate")
    return dict(base=write_base(root / "base"), cache=write_cache(root / "cache", per_bucket=4))


def _run(inputs, out, *flags):
    return run(parse_args(cache_run_flags(inputs["base"], inputs["cache"], out, "--checkpoint.every", "0", *flags)))


def _logged(out) -> list[dict[str, float]]:
    return [{key: line[key] for key in LOGGED if key in line} for line in read_metrics(out / "metrics.jsonl")]


@pytest.mark.parametrize(
    "stage",
    [
        # caption dropout on: the dropped rows of the global batch must land in the right micro-batch
        pytest.param(["--training.steps", "3", "--data.caption_dropout", "0.5"], id="fine-tune"),
        pytest.param(["--training.steps", "0", "--transfer.steps", "3", "--model.joint_mode", "hybrid"], id="transfer"),
    ],
)
def test_two_micro_batches_train_as_the_whole_batch(inputs, tmp_path, stage):
    whole = _run(inputs, tmp_path / "whole", *stage)
    split = _run(inputs, tmp_path / "split", *stage, "--training.accumulate", "2")
    logged = _logged(tmp_path / "whole")
    assert len(logged) == 3 and all("grad_norm" in line for line in logged)
    # grad_norm is before clipping: micro-batch losses left unscaled would double it (AdamW would hide it)
    assert _logged(tmp_path / "split") == [pytest.approx(line, rel=1e-5, abs=1e-7) for line in logged]
    reference, got = load_file(str(whole.weights)), load_file(str(split.weights))
    assert got.keys() == reference.keys()
    for key, value in reference.items():
        # only the order of fp32 sums differs; atol is a tenth of one AdamW step of an inherited weight (lr 1e-5)
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=lambda m, key=key: f"{key}: {m}")


def test_a_batch_that_does_not_split_into_micro_batches_is_refused_before_loading(inputs, tmp_path):
    with pytest.raises(ValueError, match=r"--training.batch_size 4 .* 1 process\(es\) x --training.accumulate 3"):
        _run(inputs, tmp_path, "--training.steps", "1", "--training.accumulate", "3")
    assert not (tmp_path / "config.toml").exists()


def test_no_micro_batches_is_refused():
    with pytest.raises(ValueError, match=r"--training.accumulate: must be at least 1 .*got 0"):
        parse_args(["--training.accumulate", "0"])


@pytest.fixture(scope="module")
def world():
    world = init_world(ParallelConfig(device="cpu"))
    yield world
    world.close()


def test_the_run_plans_memory_for_a_micro_batch_and_time_for_the_whole_batch(inputs, tmp_path, world):
    source = CacheSource(inputs["cache"])
    plans = {}
    for accumulate in (1, 2):
        flags = ("--training.accumulate", str(accumulate), "--parallel.gpu_memory_gib", "80")
        config = parse_args(cache_run_flags(inputs["base"], inputs["cache"], tmp_path, *flags))
        handle, split = build_model(load_base(config.model), config)
        batches = BatchPlan(source.buckets(), batch_size=config.training.batch_size, seed=0)
        plans[accumulate] = plan_run(config, handle, split, source=source, plan=batches, world=world, teacher=None)
    one, two = plans[1], plans[2]
    assert two.components["activations"] == pytest.approx(one.components["activations"] / 2)
    assert two.time.flops_per_step == pytest.approx(one.time.flops_per_step)


def test_gradient_sync_waits_for_the_last_micro_batch(world):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model, x = nn.Linear(3, 2), torch.randn(4, 3)
    model(x).sum().backward()
    expected = 2 * model.weight.grad
    fully_shard(model)
    with gradient_sync(model, enabled=False):
        model(x).sum().backward()
    assert model.weight.grad is None  # FSDP2 holds the unreduced gradient back
    with gradient_sync(model, enabled=True):
        model(x).sum().backward()
    torch.testing.assert_close(model.weight.grad.full_tensor(), expected)

    ddp = apply_ddp(nn.Linear(3, 2), world)
    with gradient_sync(ddp, enabled=False):
        assert not ddp.require_backward_grad_sync
    with gradient_sync(ddp, enabled=True):
        assert ddp.require_backward_grad_sync

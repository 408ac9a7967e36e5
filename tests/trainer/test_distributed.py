"""`torchrun --nproc_per_node=2` with gloo on CPU: DDP and FSDP2 match one process on the same global
batch, and a killed run resumes to the same final weights as an uninterrupted one."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from testing.trainer_assets import RECIPE_FLAGS, write_base, write_cache
from trainer.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]
RUN = str(REPO / "trainer" / "run.py")
TIMEOUT_S = 180


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def _flags(inputs: dict[str, Path], out: Path, *extra: str) -> list[str]:
    return [
        "--model.base", str(inputs["base"]),
        "--data.source", "cache",
        "--data.path", str(inputs["cache"]),
        "--model.layers", "all",
        "--model.trainable", "attention",
        "--training.batch_size", "4",
        "--optim.lr", "1e-3",
        "--output.dir", str(out),
        "--output.progress", "false",
        *RECIPE_FLAGS,
        *extra,
    ]  # fmt: skip


def _launch(command: list[str]) -> subprocess.CompletedProcess:
    done = subprocess.run(command, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-6000:]}"
    return done


def _torchrun(flags: list[str]) -> subprocess.CompletedProcess:
    # --standalone: a local rendezvous on a free port, so parallel test runs never collide.
    return _launch([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", RUN, *flags])


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    return dict(base=write_base(root / "base"), cache=write_cache(root / "cache", per_bucket=8), root=root)


@pytest.fixture(scope="module")
def single(inputs):
    out = inputs["root"] / "single"
    _launch([sys.executable, RUN, *_flags(inputs, out, "--training.steps", "4")])
    return out


def _losses(out: Path) -> list[float]:
    return [line["loss/total"] for line in read_metrics(out / "metrics.jsonl")]


def _assert_same_file(out: Path, reference_run: Path) -> dict[str, torch.Tensor]:
    """The weights file of run `out` matches that of `reference_run` tensor by tensor; returns the reference's."""
    reference, exported = load_file(str(reference_run / "t5.safetensors")), load_file(str(out / "t5.safetensors"))
    assert exported.keys() == reference.keys()
    # AdamW divides each gradient element by its running RMS, so an element whose gradient is near zero
    # carries the reordering noise into its update (1.8e-6 on one element of 512, seen on an AMD EPYC);
    # atol is a tenth of one step of a new T5 parameter (lr 1e-4), so a wrong update still fails
    for key in reference:
        torch.testing.assert_close(
            exported[key], reference[key], rtol=1e-4, atol=1e-5, msg=lambda message, key=key: f"{key}: {message}"
        )
    return reference


@pytest.mark.parametrize(
    ("mode", "extra", "interrupted"),
    [
        pytest.param("ddp", ["--training.gradient_checkpointing", "true"], False, id="ddp-gradient-checkpointing"),
        # Stopped by the time budget after step 1, then resumed by a second torchrun: FSDP2 checkpoints too.
        pytest.param("fsdp2", [], True, id="fsdp2-stopped-and-resumed"),
        # Two micro-batches of 1 per process: each rank's gradients are reduced once, after the second.
        pytest.param("ddp", ["--training.accumulate", "2"], False, id="ddp-accumulate"),
        pytest.param("fsdp2", ["--training.accumulate", "2"], False, id="fsdp2-accumulate"),
    ],
)
def test_two_processes_match_one(inputs, single, tmp_path, mode, extra, interrupted):
    out = tmp_path / mode
    flags = _flags(inputs, out, "--training.steps", "4", "--parallel.mode", mode, *extra)
    if interrupted:
        _torchrun([*flags, "--training.max_minutes", "1e-6"])
        assert [line["step"] for line in read_metrics(out / "metrics.jsonl")] == [1]
    _torchrun(flags)
    # Same global batch, noise and init; only the order of floating-point sums differs (fp32).
    torch.testing.assert_close(_losses(out), _losses(single), rtol=1e-5, atol=1e-6)
    _assert_same_file(out, single)
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["t5.safetensors"]
    assert not list(out.rglob("*.tmp"))


@pytest.fixture(scope="module")
def single_low_rank(inputs):
    out = inputs["root"] / "single-low-rank"
    flags = _flags(inputs, out, "--training.steps", "3", "--model.rank", "4", "--transfer.steps", "2")
    _launch([sys.executable, RUN, *flags])
    return out


@pytest.mark.parametrize(
    "mode",
    [
        pytest.param("ddp", id="ddp-transfer-then-low-rank"),
        # the transfer does not run under FSDP2: the fine-tune starts from the reference's finished transfer
        pytest.param("fsdp2", id="fsdp2-low-rank-after-transfer"),
    ],
)
def test_low_rank_and_transfer_over_two_processes_match_one(inputs, single_low_rank, mode):
    out = inputs["root"] / f"low-rank-{mode}"
    flags = _flags(inputs, out, "--training.steps", "3", "--model.rank", "4", "--transfer.steps", "2")
    if mode == "fsdp2":
        shutil.copytree(single_low_rank / "checkpoints" / "transfer", out / "checkpoints" / "transfer")
    _torchrun([*flags, "--parallel.mode", mode])
    fine_tune = [line for line in read_metrics(out / "metrics.jsonl") if "stage" not in line]
    reference_lines = [line for line in read_metrics(single_low_rank / "metrics.jsonl") if "stage" not in line]
    torch.testing.assert_close(
        [line["loss/total"] for line in fine_tune],
        [line["loss/total"] for line in reference_lines],
        rtol=1e-5,
        atol=1e-6,
    )
    assert any(key.endswith(".up") for key in _assert_same_file(out, single_low_rank))


@pytest.fixture(scope="module")
def single_from_file(inputs, single_low_rank):
    out = inputs["root"] / "from-file-single"
    _launch([sys.executable, RUN, *_from_file_flags(inputs, single_low_rank, out)])
    return out


def _from_file_flags(inputs: dict[str, Path], start_run: Path, out: Path, *extra: str) -> list[str]:
    # the file brings its rank (4); the transfer stays off, as a run from a file requires
    start = str(start_run / "t5.safetensors")
    return _flags(inputs, out, "--training.steps", "3", "--model.start_from", start, *extra)


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_a_run_from_a_file_over_two_processes_stopped_and_resumed_matches_one(
    inputs, single_low_rank, single_from_file, mode
):
    out = inputs["root"] / f"from-file-{mode}"
    flags = _from_file_flags(inputs, single_low_rank, out, "--parallel.mode", mode)
    _torchrun([*flags, "--training.max_minutes", "1e-6"])
    assert [line["step"] for line in read_metrics(out / "metrics.jsonl")] == [1]
    _torchrun(flags)
    torch.testing.assert_close(_losses(out), _losses(single_from_file), rtol=1e-5, atol=1e-6)
    assert any(key.endswith(".up") for key in _assert_same_file(out, single_from_file))


# Runs the trainer with its step-2 checkpoint save followed by a hang, so the test kills a run that
# is still going at a known point (a tiny run can otherwise finish between two polls).
_HANG_AFTER_STEP_2 = """
import runpy, sys, time
from trainer.checkpoint import CheckpointManager
save = CheckpointManager.save
def save_then_hang(self, step, **kwargs):
    path = save(self, step, **kwargs)
    if step == 2:
        time.sleep(3600)
    return path
CheckpointManager.save = save_then_hang
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_killed_run_resumes_to_the_same_weights(inputs, single):
    out = inputs["root"] / "killed"
    flags = _flags(inputs, out, "--training.steps", "4", "--checkpoint.every", "1")
    command = [sys.executable, "-c", _HANG_AFTER_STEP_2, RUN, *flags]
    process = subprocess.Popen(command, cwd=REPO, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not (out / "checkpoints" / "step-2" / "state.json").is_file():
            assert process.poll() is None, "the run ended before it could be killed"
            assert time.monotonic() < deadline
            time.sleep(0.05)
        process.send_signal(signal.SIGKILL)
    finally:
        process.wait(timeout=TIMEOUT_S)
    assert not (out / "t5.safetensors").exists()
    _launch([sys.executable, RUN, *flags])
    assert [line["step"] for line in read_metrics(out / "metrics.jsonl")] == [1, 2, 3, 4]
    reference, resumed = load_file(str(single / "t5.safetensors")), load_file(str(out / "t5.safetensors"))
    for key in reference:
        # Same process count and thread count as the reference: the resumed run is bit-identical.
        assert torch.equal(resumed[key], reference[key]), key


def test_an_error_in_rank_0_file_work_ends_every_rank(tmp_path):
    """Any error on rank 0's file work (not only OSError and ValueError) reaches the other ranks, which
    would otherwise wait in the next collective until the timeout."""
    script = tmp_path / "fail_on_main.py"
    script.write_text(
        "from trainer.config import ParallelConfig\n"
        "from trainer.distributed import init_world\n"
        "from trainer.train import _on_main\n"
        "world = init_world(ParallelConfig(device='cpu'))\n"
        "try:\n"
        "    _on_main(world, lambda: {}['missing'])\n"
        "except KeyError:\n"
        "    print(f'rank {world.rank}: KeyError', flush=True)\n"
        "finally:\n"
        "    world.close()\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)],
        cwd=REPO, env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    # the two ranks print to one pipe, so one's line may land inside the other's
    assert sorted(re.findall(r"rank \d: KeyError", done.stdout)) == [
        "rank 0: KeyError",
        "rank 1: KeyError",
    ]


def test_a_torch_older_than_the_trainers_floor_is_refused_at_start(monkeypatch):
    from trainer.config import ParallelConfig
    from trainer.distributed import init_world

    monkeypatch.setattr(torch, "__version__", torch.torch_version.TorchVersion("2.10.0+cu128"))
    match = r"the trainer needs torch >= 2\.11 .*; this is torch 2\.10\.0\+cu128\. Upgrade torch: .*'torch>=2\.11'"
    with pytest.raises(RuntimeError, match=match):
        init_world(ParallelConfig(device="cpu"))

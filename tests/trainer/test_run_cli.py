"""`trainer/run.py` as a user meets it: a finished run is never silently redone or its report blanked,
`--checkpoint.resume` says what happens to an earlier run, abbreviated flags are refused, and a bad
setting is one line on stderr with no traceback."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from testing.trainer_assets import RECIPE_FLAGS, write_base, write_cache
from trainer.metrics import read_metrics
from trainer.run import main


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("run_cli")
    return dict(base=write_base(root / "base"), cache=write_cache(root / "cache", per_bucket=4))


def _argv(inputs, out, *extra: str) -> list[str]:
    return [
        "--model.base", str(inputs["base"]),
        "--data.source", "cache",
        "--data.path", str(inputs["cache"]),
        "--training.batch_size", "4",
        "--training.steps", "2",
        "--output.dir", str(out),
        "--output.progress", "false",
        *RECIPE_FLAGS,
        *extra,
    ]  # fmt: skip


def _weights(path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A weights file's tensors and metadata (its bytes order the metadata as the writer's hash map does)."""
    with safe_open(str(path), "pt") as file:
        return {name: file.get_tensor(name) for name in file.keys()}, file.metadata()


def _outputs(out) -> dict[str, bytes]:
    return {str(path.relative_to(out)): path.read_bytes() for path in out.rglob("*") if path.is_file()}


def test_a_finished_run_is_left_untouched_and_says_how_to_train_again(inputs, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(_argv(inputs, out)) == 0
    first = capsys.readouterr().out
    assert "trained to step 2 (--training.steps reached), last loss" in first and "report.md" in first
    report = (out / "report.md").read_text()
    assert "\n* converted_layers: blocks." in report  # a list is one line
    before = _outputs(out)

    assert main(_argv(inputs, out)) == 0
    again = capsys.readouterr().out
    assert "holds a finished run (step 2 of 2); nothing was changed" in again
    assert "--checkpoint.resume force" in again and "--training.steps" in again
    assert _outputs(out) == before


def test_a_checkpoint_past_the_requested_steps_is_refused(inputs, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(_argv(inputs, out)) == 0
    before = _outputs(out)
    capsys.readouterr()
    assert main(_argv(inputs, out, "--training.steps", "1")) == 2
    error = capsys.readouterr().err
    assert error.startswith("trainer/run.py: error: ") and error.count("\n") == 1
    assert "checkpoint at step 2, past --training.steps 1; nothing was changed" in error
    assert _outputs(out) == before


def test_a_finished_run_can_be_trained_longer_or_again_from_the_start(inputs, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(_argv(inputs, out)) == 0
    assert main(_argv(inputs, out, "--training.steps", "3")) == 0
    assert "trained to step 3" in capsys.readouterr().out
    assert [row["step"] for row in read_metrics(out / "metrics.jsonl")] == [1, 2, 3]
    assert sorted(path.name for path in (out / "checkpoints").iterdir()) == ["step-2", "step-3"]

    assert main(_argv(inputs, out, "--training.steps", "2", "--checkpoint.resume", "force")) == 0
    assert "trained to step 2" in capsys.readouterr().out
    assert [row["step"] for row in read_metrics(out / "metrics.jsonl")] == [1, 2]
    assert sorted(path.name for path in (out / "checkpoints").iterdir()) == ["step-2"]


def test_abbreviated_flags_are_refused(inputs, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--training.step", "20", "--output.dir", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --training.step 20" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "toml, match",
    [
        pytest.param("[training]\nstep = 20\n", "[training] has unknown key(s) ['step']", id="unknown-key"),
        pytest.param("[training]\nsteps = 'many'\n", "--training.steps: expected int, got str 'many'", id="bad-type"),
        pytest.param("[trainin]\nsteps = 2\n", "[trainin] is not a section", id="unknown-section"),
    ],
)
def test_a_bad_config_file_is_one_line_without_a_traceback(tmp_path, capsys, toml, match):
    path = tmp_path / "bad.toml"
    path.write_text(toml)
    assert main(["--config", str(path)]) == 2
    error = capsys.readouterr().err
    assert error.startswith("trainer/run.py: error: ") and error.count("\n") == 1
    assert match in error and "Traceback" not in error


def test_a_one_process_run_gives_no_ddp_stride_warning(inputs, tmp_path):
    """No "Grad strides do not match bucket view strides" warning from DDP: autograd's weight gradient of
    the locality conv on a channels-last view would have other strides than DDP's bucket, and the
    chunked path computes that gradient itself."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(_argv(inputs, tmp_path / "out")) == 0
    assert not [w for w in caught if "Grad strides do not match" in str(w.message)]


def test_a_run_whose_export_did_not_complete_is_exported_from_its_last_checkpoint(inputs, tmp_path, capsys):
    """A crash after the last checkpoint (in the export, the evaluation or the copy to ComfyUI) leaves a finished
    run without its weights file: the same command writes it again, from that checkpoint, with no step
    trained, and the file is the uninterrupted run's."""
    out = tmp_path / "out"
    assert main(_argv(inputs, out)) == 0
    weights = out / "t5.safetensors"
    first = _weights(weights)
    checkpoints = {name: data for name, data in _outputs(out).items() if name.startswith("checkpoints/")}
    weights.unlink()
    capsys.readouterr()

    assert main(_argv(inputs, out)) == 0
    assert "trained to step 2" in capsys.readouterr().out
    second = _weights(weights)
    assert second[1] == first[1] and second[0].keys() == first[0].keys()
    for name, tensor in first[0].items():
        torch.testing.assert_close(second[0][name], tensor, rtol=0, atol=0)
    assert {name: data for name, data in _outputs(out).items() if name.startswith("checkpoints/")} == checkpoints
    assert [row["step"] for row in read_metrics(out / "metrics.jsonl")] == [1, 2]


def test_a_resume_with_other_settings_is_refused_before_the_base_is_loaded(inputs, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    assert main(_argv(inputs, out, "--checkpoint.every", "1", "--training.steps", "1")) == 0
    before = _outputs(out)
    capsys.readouterr()

    def no_loading(*_args, **_kwargs):
        raise AssertionError("the base was loaded before the checkpoint's settings were checked")

    monkeypatch.setattr("trainer.train.load_base", no_loading)
    assert main(_argv(inputs, out, "--training.seed", "1")) == 2
    assert "trained with other settings: --training.seed 0 -> 1" in capsys.readouterr().err
    assert main(_argv(inputs, out, "--checkpoint.resume", str(out / "checkpoints" / "step-7"))) == 2
    assert "step-7 is not a complete checkpoint" in capsys.readouterr().err
    assert _outputs(out) == before


def test_a_run_that_does_not_fit_the_memory_is_one_line_without_a_traceback(inputs, tmp_path, capsys):
    assert main(_argv(inputs, tmp_path / "out", "--parallel.gpu_memory_gib", "0.5")) == 2
    error = capsys.readouterr().err
    assert error.startswith("trainer/run.py: error: ") and error.count("\n") == 1
    assert "needs about" in error and "but has 0.5 GiB" in error and "Try:" in error


def test_the_time_budget_counts_the_training_before_a_resume(inputs, tmp_path, capsys):
    """`--training.max_minutes` is the run's budget, not each session's: a run stopped by it is finished,
    and a resumed run has only what its checkpoint left (a killed run trains no longer than an uninterrupted one)."""
    out = tmp_path / "out"
    budget = ("--training.steps", "50", "--training.max_minutes", "1e-6")
    assert main(_argv(inputs, out, *budget)) == 0
    assert "trained to step 1 (--training.max_minutes spent)" in capsys.readouterr().out
    before = _outputs(out)
    assert main(_argv(inputs, out, *budget)) == 0
    assert (
        "(its --training.max_minutes 1e-06 was spent at step 1 of 50); nothing was changed" in capsys.readouterr().out
    )
    assert _outputs(out) == before

    state_file = out / "checkpoints" / "step-1" / "state.json"
    state = json.loads(state_file.read_text())
    assert state["trained_seconds"] > 0
    state_file.write_text(json.dumps({**state, "trained_seconds": 60 - 1e-3}))  # 1 ms of a 1-minute budget left
    assert main(_argv(inputs, out, "--training.steps", "50", "--training.max_minutes", "1")) == 0
    assert "trained to step 2 (--training.max_minutes spent)" in capsys.readouterr().out
    resumed = json.loads((out / "checkpoints" / "step-2" / "state.json").read_text())
    assert resumed["trained_seconds"] > 60 - 1e-3

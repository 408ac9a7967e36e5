"""`experiments/reuse.py` end to end on a handful of samples: a toy delta file from a short trainer run, a
one-step fine-tune of the teacher, every row of the comparison, the absolute-value file it builds, the
file of the same recipe trained on the fine-tune and the file adapted to the fine-tune.

The script runs as a subprocess: tests do not import `experiments/`.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from sd3_testbed.model import WEIGHTS_FILE, load_toy_base, toy_arch
from t5core.deltas import fingerprint
from t5core.file_stamp import sha256_file
from t5core.hosts.diffusers import linearize
from t5core.weights import load
from trainer.cli import parse_args
from trainer.train import run as train

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = 3
ROWS = ["teacher", "teacher+deltas", "finetune", "finetune+deltas", "finetune+absolute", "finetune+own"]
ROWS += ["finetune+adapted-1"]
RECIPE = ["--model.layers", "all", "--model.joint_mode", "hybrid", "--model.rank", "4", "--transfer.steps", "1"]
RECIPE += ["--training.steps", "1", "--training.batch_size", "2"]


def _reuse(t5_file: Path, folder: Path, recipe: list[str]) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "experiments.reuse", "--t5-file", str(t5_file), "--samples", str(SAMPLES)]
    command += ["--seeds", "0", "1", "--finetune-steps", "1", "--results-dir", str(folder)]
    command += ["--own", "--recipe", shlex.join(recipe), "--adapt", "1", "--adapt-recipe", "--training.batch_size 2"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def reuse(tmp_path_factory):
    """A rank-4 `all` hybrid delta file (one transfer step, one fine-tune step), and the reuse benchmark run
    on it with a one-step fine-tune of the teacher and the same recipe trained on that; returns the folder and
    the file."""
    folder = tmp_path_factory.mktemp("reuse")
    flags = [*RECIPE, "--output.toy_eval_samples", "0", "--output.progress", "false", "--checkpoint.every", "0"]
    t5_file = train(parse_args([*flags, "--output.dir", str(folder / "run")])).weights
    done = _reuse(t5_file, folder, RECIPE)
    assert done.returncode == 0, done.stderr[-4000:]
    return folder, Path(t5_file)


def test_every_row_is_scored_on_the_same_samples_with_paired_intervals(reuse):
    folder, _ = reuse
    result = json.loads((folder / "reuse.json").read_text())
    rows = {row["row"]: row for row in result["rows"]}
    assert list(rows) == ROWS
    assert [rows[name]["palette"] for name in ROWS] == ["default"] * 2 + ["rotated"] * 5
    for row in rows.values():
        hits = row["hits"]
        assert set(hits) == {"color", "shape", "position", "size", "overall"}
        assert all(len(column) == 2 * SAMPLES for column in hits.values())
        assert row["toyeval"]["overall"] == sum(hits["overall"]) / (2 * SAMPLES)
        attributes = zip(hits["color"], hits["shape"], hits["position"], hits["size"], strict=True)
        assert hits["overall"] == [int(all(sample)) for sample in attributes]
        assert row["val_loss"] > 0
    pairs = {(pair["row"], pair["reference"]): pair for pair in result["meta"]["pairs"]}
    assert set(pairs) == {
        ("teacher+deltas", "teacher"),
        ("finetune+deltas", "finetune"),
        ("finetune+absolute", "finetune"),
        ("finetune+own", "finetune"),
        ("finetune+deltas", "finetune+absolute"),
        ("finetune+deltas", "finetune+own"),
        ("finetune+adapted-1", "finetune"),
        ("finetune+adapted-1", "finetune+deltas"),
        ("finetune+adapted-1", "finetune+own"),
    }
    for (name, reference), pair in pairs.items():
        mean = (sum(rows[name]["hits"]["overall"]) - sum(rows[reference]["hits"]["overall"])) / (2 * SAMPLES)
        assert pair["mean"] == pytest.approx(mean)
        assert pair["low"] <= pair["mean"] <= pair["high"]
    assert result["meta"]["samples"] == SAMPLES and result["meta"]["seeds"] == [0, 1]
    # the fine-tune and every row's samples are cached for the next run
    cache = folder / ".cache"
    assert len(list(cache.glob("finetune-*.safetensors"))) == 1
    assert len(list(cache.glob("softmax-*-seed1-3-raw.safetensors"))) == 2
    assert len(list(cache.glob("t5-*-on-*-seed1-3-raw.safetensors"))) == 5


def _made_on_the_fine_tune(folder: Path, t5_file: Path, kind: str):
    """The `kind` file (`own`, `adapted`) cached beside the fine-tune and the teacher's file, loaded, once the former
    is checked to record the fine-tune's fingerprint and to hold the latter's T5 config and deltas."""
    (finetune,) = (folder / ".cache").glob("finetune-*.safetensors")
    (path,) = (folder / ".cache").glob(f"{kind}-*/t5.safetensors")
    made, teacher_file = load(path), load(t5_file)
    assert made.fingerprint == fingerprint(load_file(str(finetune)), toy_arch())
    assert made.config == teacher_file.config and made.deltas.keys() == teacher_file.deltas.keys()
    return path, made, teacher_file


def test_the_own_file_is_the_same_recipe_trained_on_the_fine_tune(reuse):
    """The upper bound's file: the recipe's T5 modules and deltas, its fingerprint the fine-tune's."""
    folder, t5_file = reuse
    own_path, own, teacher_file = _made_on_the_fine_tune(folder, t5_file, "own")
    assert teacher_file.fingerprint == fingerprint(load_file(str(WEIGHTS_FILE)), toy_arch())
    assert {k: v for k, v in own.provenance.items() if k != "base"} == {
        k: v for k, v in teacher_file.provenance.items() if k != "base"
    }
    result = json.loads((folder / "reuse.json").read_text())
    assert result["meta"]["own"]["t5_sha256_16"] == sha256_file(own_path)[:16]


def test_the_adapted_file_starts_from_the_file_and_holds_deltas_against_the_fine_tune(reuse):
    folder, t5_file = reuse
    adapted_path, adapted, teacher_file = _made_on_the_fine_tune(folder, t5_file, "adapted")
    assert adapted.provenance["started_from"] == t5_file.name and adapted.provenance["steps"] == "1"
    assert {key: delta.rank for key, delta in adapted.deltas.items()} == {
        key: delta.rank for key, delta in teacher_file.deltas.items()
    }
    result = json.loads((folder / "reuse.json").read_text())
    assert result["meta"]["adapted"]["t5_sha256_16"] == {"1": sha256_file(adapted_path)[:16]}


def test_a_recipe_that_did_not_make_the_file_is_refused_before_sampling(reuse):
    folder, t5_file = reuse
    sampled = set((folder / ".cache").glob("*-raw.safetensors"))
    done = _reuse(t5_file, folder, [*RECIPE, "--model.rank", "8"])
    assert done.returncode == 2 and "does not make" in done.stderr and "'rank'" in done.stderr
    assert set((folder / ".cache").glob("*-raw.safetensors")) == sampled


def test_the_absolute_file_holds_the_teacher_plus_the_deltas_bit_for_bit(reuse):
    folder, t5_file = reuse
    (path,) = (folder / ".cache").glob("absolute-*.safetensors")
    deltas, absolute = load(t5_file), load(path)
    with safe_open(str(path), framework="pt") as handle:
        assert int(handle.metadata()["t5.format_version"]) <= 3
    assert not absolute.deltas and absolute.config == deltas.config and absolute.arch == deltas.arch
    for module, tensors in deltas.modules.items():
        assert tensors.keys() == absolute.modules[module].keys()
        assert all(torch.equal(tensor, absolute.modules[module][name]) for name, tensor in tensors.items())
    teacher = load_file(str(WEIGHTS_FILE))
    assert absolute.base.keys() == deltas.deltas.keys()
    for key, delta in deltas.deltas.items():
        assert absolute.base[key].dtype == torch.float32
        assert torch.equal(absolute.base[key], teacher[key].float() + delta.full()), key


def test_on_the_teacher_the_absolute_file_and_the_delta_file_give_one_model(reuse):
    folder, t5_file = reuse
    (path,) = (folder / ".cache").glob("absolute-*.safetensors")
    added = linearize(load_toy_base(), weights=t5_file, backend="torch").model.state_dict()
    replaced = linearize(load_toy_base(), weights=path, backend="torch").model.state_dict()
    assert added.keys() == replaced.keys()
    assert all(torch.equal(added[name], replaced[name]) for name in added)

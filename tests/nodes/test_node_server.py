"""T5 Linearize's own inputs and outputs in a real ComfyUI server (`testing.comfy_server`), with its
execution cache on: a `layers` subset applies only the file's changes that go with the modules it
converts; a weights file replaced under the same name is read again on the next prompt (also when the
copy keeps its size and modification time); `start_percent` / `end_percent` run softmax outside that
part of sampling; the `status` output says what the node did.

The expectations do not go through the node's choices: a checkpoint with the kept deltas written in and
a file without changes, the same file under a second name, or the node turned off.

Runs on the tree `testing.comfy_env` finds (`COMFYUI_PATH`), skips when there is none.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from t5core.hosts.diffusers import arch_of
from testing import comfy_env, comfy_tiny
from testing.comfy_prompts import sampling_prompt, saved_latents
from testing.comfy_server import ComfyServer
from testing.models import tiny_transformer
from testing.tolerances import relative_rms

pytestmark = pytest.mark.comfyui  # a real server of the tree under test: runs on the floor tree too

CHECKPOINT, MERGED = "tiny_node.safetensors", "tiny_node_kept_deltas.safetensors"
PLAIN, DELTAS, SWAPPED = "plain.safetensors", "all_deltas.safetensors", "swapped.safetensors"
PREFIX = "model.diffusion_model."
SUBSET = "blocks.1.attn"
# the file converts blocks.0.attn, blocks.0.attn2 and blocks.1.attn; with SUBSET only block 1's stays
KEPT = ("joint_blocks.1.x_block.attn.qkv.weight",)
LEFT_OUT = (
    "joint_blocks.0.x_block.attn.qkv.weight",
    "joint_blocks.0.x_block.attn2.proj.weight",
    "joint_blocks.0.x_block.mlp.fc1.weight",
)
SCHEDULE_STEPS = 4
SAME = 1e-5  # fp32, the same weights summed in another order: ~1e-7 apart


def _seeded_file(models: Path, name: str, seed: int) -> Path:
    arch = arch_of(tiny_transformer(comfy_tiny.PRESET))
    return comfy_tiny.write_t5_weights(models / "t5_linearize" / name, arch, arch.attention_modules(), seed=seed)


def _write_assets(models: Path) -> None:
    transformer = tiny_transformer(comfy_tiny.PRESET)
    arch = arch_of(transformer)
    state = load_file(str(comfy_tiny.write_checkpoint(models / "checkpoints" / CHECKPOINT, transformer)))
    shapes = {key: tuple(state[PREFIX + key].shape) for key in (*KEPT, *LEFT_OUT)}
    deltas, dense = comfy_tiny.seeded_deltas(shapes, low_rank=(KEPT[0], LEFT_OUT[0]), seed=31, std=0.25)
    merged = {PREFIX + key: state[PREFIX + key] + dense[key] for key in KEPT}
    save_file({**state, **merged}, str(models / "checkpoints" / MERGED))
    folder = models / "t5_linearize"
    comfy_tiny.write_t5_weights(folder / DELTAS, arch, arch.attention_modules(), seed=5, deltas=deltas)
    _seeded_file(models, PLAIN, seed=5)
    for seed in (9, 11):
        _seeded_file(models, f"seed{seed}.safetensors", seed=seed)
    shutil.copy2(folder / PLAIN, folder / SWAPPED)


def _replace_keeping_stat(source: Path, target: Path) -> None:
    """Copy `source` over `target` as a sync tool might: same size, the old modification time kept."""
    before = target.stat()
    assert source.stat().st_size == before.st_size, "the copy must keep the size for the test to mean anything"
    shutil.copyfile(source, target)
    os.utime(target, ns=(before.st_atime_ns, before.st_mtime_ns))


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Every prompt's latents (and the status text where a PreviewAny shows it), by name, in order,
    from one server whose cache stays on across them."""
    tree = comfy_env.require_tree()
    base_dir = tmp_path_factory.mktemp("comfy_node_server")
    models = base_dir / "models"
    _write_assets(models)
    folder = models / "t5_linearize"
    plain_schedule = dict(weights=PLAIN, steps=SCHEDULE_STEPS)
    runs: list[tuple[str, dict, object]] = [
        ("subset", dict(weights=DELTAS, layers=SUBSET), None),
        ("subset_expected", dict(checkpoint=MERGED, layers=SUBSET), None),
        ("swapped_first", dict(weights=SWAPPED), None),
        ("swapped_again", dict(weights=SWAPPED), None),
        (
            "swapped_rewritten",
            dict(weights=SWAPPED),
            lambda: shutil.copyfile(folder / "seed9.safetensors", folder / SWAPPED),
        ),
        ("seed9", dict(weights="seed9.safetensors"), None),
        (
            "swapped_same_stat",
            dict(weights=SWAPPED),
            lambda: _replace_keeping_stat(folder / "seed11.safetensors", folder / SWAPPED),
        ),
        ("seed11", dict(weights="seed11.safetensors"), None),
        ("softmax", dict(plain_schedule, enabled=False), None),
        ("t5", dict(plain_schedule), None),
        ("whole_schedule", dict(plain_schedule, schedule=(0.0, 1.0)), None),
        ("never", dict(plain_schedule, schedule=(1.0, 1.0)), None),
        ("late", dict(plain_schedule, schedule=(0.3, 1.0)), None),
    ]
    out = {}
    with ComfyServer.start(tree, base_dir, custom_nodes=(comfy_env.TESTING_NODES,)) as server:
        for name, options, before in runs:
            if before is not None:
                before()
            prompt = sampling_prompt(**{"checkpoint": CHECKPOINT, "weights": PLAIN, "prefix": name, **options})
            prompt["20"] = {"class_type": "PreviewAny", "inputs": {"source": ["3", 1]}}
            outputs = server.wait(server.queue(prompt))["outputs"]
            status = outputs.get("20", {}).get("text", [""])[0]
            out[name] = {"latents": saved_latents(base_dir / "output", outputs), "status": status}
    return out


def test_a_subset_applies_only_the_changes_of_the_modules_it_converts(outcomes):
    """Block 0's attention deltas and its MLP's go with the modules left out; block 1's qkv stays."""
    subset, expected = outcomes["subset"]["latents"], outcomes["subset_expected"]["latents"]
    assert relative_rms(expected, subset) < SAME
    status = outcomes["subset"]["status"]
    assert "T5 attention on 1 of 3 attention modules (blocks.1.attn)" in status
    assert "1 of 3 modules the file converts; 1 deltas added (1 low rank, 0 full); 3 changes" in status


def test_a_file_replaced_under_the_same_name_is_read_again(outcomes):
    latents = {name: outcomes[name]["latents"] for name in outcomes}
    assert torch.equal(latents["swapped_first"], latents["swapped_again"])
    assert not torch.equal(latents["swapped_rewritten"], latents["swapped_first"])
    assert torch.equal(latents["swapped_rewritten"], latents["seed9"])
    assert torch.equal(latents["swapped_same_stat"], latents["seed11"])


def test_the_schedule_runs_softmax_outside_its_range(outcomes):
    latents = {name: outcomes[name]["latents"] for name in ("softmax", "t5", "whole_schedule", "never", "late")}
    assert torch.equal(latents["whole_schedule"], latents["t5"])
    assert torch.equal(latents["never"], latents["softmax"]), "a file without weight changes, T5 never: softmax"
    assert relative_rms(latents["t5"], latents["softmax"]) > 1e-2, "T5 must change the latents to mean anything"
    assert (
        relative_rms(latents["late"], latents["t5"]) > 1e-3 and relative_rms(latents["late"], latents["softmax"]) > 1e-3
    )
    assert "schedule: T5 from 30% to 100% of sampling (softmax outside)" in outcomes["late"]["status"]
    assert "schedule: T5 every step" in outcomes["t5"]["status"]


def test_the_status_says_what_the_node_did(outcomes):
    status = outcomes["t5"]["status"].splitlines()
    assert status[0] == f"T5 Linearize: {PLAIN}"
    assert status[1].startswith("modules: T5 attention on 3 of 3 attention modules")
    assert status[2].startswith("backend: torch (") and status[2].endswith(") on cpu"), "no CUDA here"
    assert status[4] == "base: not recorded in the file"
    assert outcomes["softmax"]["status"] == "T5 Linearize: off (the model passes through unchanged)"

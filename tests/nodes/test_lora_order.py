"""A LoRA loader before or after T5 Linearize, in a real ComfyUI server (`testing.comfy_server`), with
LoRA files in the two namings ComfyUI maps for SD3: kohya (`lora_unet_*`) and diffusers
(`transformer.*`). Two T5 files change a converted joint qkv, an `attn2` output projection and a q/k
RMSNorm scale: one with `base.*` (fine-tuned values, format 1), one with deltas (format 4: the qkv
low rank in three parts, the projection low rank, the scale a full diff). Each LoRA touches those and
a weight the files leave alone.

The expectation does not go through the file's changes at all: a checkpoint with the fine-tuned
values (or the deltas added) written into it, a T5 file without them (the same T5 modules) and the
same LoRA.

Runs on the tree `testing.comfy_env` finds (`COMFYUI_PATH`), skips when there is none.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from t5core.deltas import fingerprint
from t5core.hosts.diffusers import arch_of
from testing import comfy_env, comfy_tiny
from testing.comfy_prompts import ModelNode, lora_node, sampling_prompt, saved_latents
from testing.comfy_server import ComfyServer
from testing.models import tiny_transformer
from testing.tolerances import relative_rms

pytestmark = pytest.mark.comfyui  # a real server of the tree under test: runs on the floor tree too

CHECKPOINT, T5_PLAIN = "tiny_lora.safetensors", "t5_without_changes.safetensors"
# per kind of file: the T5 file with the changes, and the checkpoint with them written in
FILES = {
    "base": ("t5_with_base.safetensors", "tiny_lora_merged_base.safetensors"),
    "deltas": ("t5_with_deltas.safetensors", "tiny_lora_merged_deltas.safetensors"),
}
PREFIX = "model.diffusion_model."
QKV = "joint_blocks.1.x_block.attn.qkv.weight"
PROJ = "joint_blocks.0.x_block.attn2.proj.weight"
NORM = "joint_blocks.1.x_block.attn.ln_q.weight"
UNTOUCHED = "joint_blocks.0.x_block.mlp.fc1.weight"
# The LoRA-visible name (before `.lora_up` / `.diff`) of each weight, per naming; the diffusers q of a
# fused qkv is a slice of it, which ComfyUI patches through an offset.
LORA_NAMES = {
    "kohya": {
        QKV: "lora_unet_joint_blocks_1_x_block_attn_qkv",
        PROJ: "lora_unet_joint_blocks_0_x_block_attn2_proj",
        NORM: "lora_unet_joint_blocks_1_x_block_attn_ln_q",
        UNTOUCHED: "lora_unet_joint_blocks_0_x_block_mlp_fc1",
    },
    "diffusers": {
        QKV: "transformer.transformer_blocks.1.attn.to_q",
        PROJ: "transformer.transformer_blocks.0.attn2.to_out.0",
        NORM: "transformer.transformer_blocks.1.attn.norm_q",
        UNTOUCHED: "transformer.transformer_blocks.0.ff.net.0.proj",
    },
}
RANK = 4
# fp32 throughout; the same weights summed in another order (stored + (trained - stored) + LoRA), and
# two sampling steps: ~1e-7 apart; a LoRA or fine-tuned weight lost would be ~1e-1.
SAME = 1e-5


def _lora(naming: str, state: dict[str, torch.Tensor], generator: torch.Generator) -> dict[str, torch.Tensor]:
    """A rank-4 LoRA on QKV, PROJ and UNTOUCHED (a full `.diff` on NORM, a vector), in `naming`."""
    tensors = {}
    for weight, name in LORA_NAMES[naming].items():
        shape = state[PREFIX + weight].shape
        if len(shape) == 1:
            tensors[f"{name}.diff"] = 0.3 * torch.randn(shape, generator=generator)
            continue
        rows = shape[0] // 3 if naming == "diffusers" and weight == QKV else shape[0]
        up, down = (
            0.3 * torch.randn(rows, RANK, generator=generator),
            0.3 * torch.randn(RANK, shape[1], generator=generator),
        )
        if naming == "kohya":
            tensors.update({f"{name}.lora_up.weight": up, f"{name}.lora_down.weight": down})
            tensors[f"{name}.alpha"] = torch.tensor(float(RANK))
        else:
            tensors.update({f"{name}.lora_B.weight": up, f"{name}.lora_A.weight": down})
    return tensors


def _write_assets(models: Path) -> None:
    """Checkpoint, a merged checkpoint per T5 file, the T5 files, one LoRA per naming."""
    transformer = tiny_transformer(comfy_tiny.PRESET)
    checkpoint = comfy_tiny.write_checkpoint(models / "checkpoints" / CHECKPOINT, transformer)
    state = load_file(str(checkpoint))
    generator = torch.Generator().manual_seed(21)
    base = {
        key: state[PREFIX + key] + 0.2 * torch.randn(state[PREFIX + key].shape, generator=generator)
        for key in (QKV, PROJ, NORM)
    }
    shapes = {key: tuple(state[PREFIX + key].shape) for key in (QKV, PROJ, NORM)}
    deltas, dense = comfy_tiny.seeded_deltas(shapes, low_rank=(QKV, PROJ), seed=22, std=0.25)
    changed = {"base": base, "deltas": {key: state[PREFIX + key] + delta for key, delta in dense.items()}}
    arch = arch_of(transformer)
    folder = models / "t5_linearize"
    for kind, (_, merged) in FILES.items():
        written = {PREFIX + key: value for key, value in changed[kind].items()}
        save_file({**state, **written}, str(models / "checkpoints" / merged))
    comfy_tiny.write_t5_weights(folder / FILES["base"][0], arch, arch.attention_modules(), seed=5, base=base)
    stamp = fingerprint({key.removeprefix(PREFIX): t for key, t in state.items()}, arch)
    comfy_tiny.write_t5_weights(
        folder / FILES["deltas"][0], arch, arch.attention_modules(), seed=5, deltas=deltas, fingerprint=stamp
    )
    comfy_tiny.write_t5_weights(folder / T5_PLAIN, arch, arch.attention_modules(), seed=5)
    (models / "loras").mkdir(parents=True, exist_ok=True)
    for naming in LORA_NAMES:
        save_file(_lora(naming, state, generator), str(models / "loras" / f"{naming}.safetensors"))


@pytest.fixture(scope="module")
def latents(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """Every prompt's latents, by name, from one server."""
    tree = comfy_env.require_tree()
    base_dir = tmp_path_factory.mktemp("comfy_lora_server")
    _write_assets(base_dir / "models")
    runs: dict[str, dict] = {}
    for kind, (t5_file, merged) in FILES.items():
        runs[kind] = dict(weights=t5_file)
        runs[f"{kind}_merged"] = dict(checkpoint=merged)
        for naming in LORA_NAMES:
            lora: list[ModelNode] = [lora_node(f"{naming}.safetensors")]
            runs[f"{kind}_{naming}_before"] = dict(weights=t5_file, before=lora)
            runs[f"{kind}_{naming}_after"] = dict(weights=t5_file, after=lora)
            runs[f"{kind}_{naming}_expected"] = dict(checkpoint=merged, after=lora)
    zero: list[ModelNode] = [lora_node("kohya.safetensors", strength=0.0)]
    runs.update(
        zero_before=dict(weights=FILES["base"][0], before=zero), zero_after=dict(weights=FILES["base"][0], after=zero)
    )
    out = {}
    with ComfyServer.start(tree, base_dir, custom_nodes=(comfy_env.TESTING_NODES,)) as server:
        for name, options in runs.items():
            prompt = sampling_prompt(**{"checkpoint": CHECKPOINT, "weights": T5_PLAIN, "prefix": name, **options})
            entry = server.wait(server.queue(prompt))
            out[name] = saved_latents(base_dir / "output", entry["outputs"])
    return out


@pytest.mark.parametrize("kind", list(FILES))
def test_the_files_changes_give_the_checkpoint_that_holds_them(latents, kind):
    """No LoRA: the file's `base.*` (as differences) or deltas give the checkpoint with the fine-tuned
    values written in."""
    assert relative_rms(latents[f"{kind}_merged"], latents[kind]) < SAME


@pytest.mark.parametrize("kind", list(FILES))
@pytest.mark.parametrize("naming", list(LORA_NAMES))
def test_a_lora_before_or_after_t5_linearize_gives_the_same_model(latents, naming, kind):
    expected = latents[f"{kind}_{naming}_expected"]
    assert relative_rms(latents[kind], expected) > 0.05, (
        "the LoRA must change the latents for the test to mean anything"
    )
    assert relative_rms(expected, latents[f"{kind}_{naming}_after"]) < SAME
    assert relative_rms(expected, latents[f"{kind}_{naming}_before"]) < SAME


def test_a_lora_at_strength_zero_gives_t5_alone(latents):
    assert torch.equal(latents["zero_before"], latents["base"])
    assert torch.equal(latents["zero_after"], latents["base"])

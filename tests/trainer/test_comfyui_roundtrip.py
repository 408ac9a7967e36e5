"""The whole trip a ComfyUI user makes: from the files of a ComfyUI install (checkpoint with bundled text
encoders, ComfyUI's tokenizers) and nothing but prompts, train, install the weights into a real
ComfyUI, and run them there through the node on the same checkpoint ComfyUI loads."""

from __future__ import annotations

import torch

from testing import comfy_tiny
from testing.trainer_assets import write_comfyui
from trainer.run import main

NAME = "roundtrip_t5.safetensors"


def test_a_prompts_run_from_a_comfyui_install_runs_in_the_node(comfy, tmp_path):
    from comfy.sd import load_diffusion_model

    install = write_comfyui(tmp_path / "install", bundled=True, preset="comfy_sd35_medium_like")
    comfy.models_dir.mkdir(parents=True, exist_ok=True)  # a real install has it from the start
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle on black\na small blue square\n")
    argv = [
        "--model.comfyui", str(install["comfyui"]), "--model.config", str(install["configs"]),
        "--data.source", "prompts", "--data.path", str(prompts), "--data.resolution", "32",
        "--data.buckets", "1:1", "--data.generate_steps", "2", "--data.max_sequence_length", "8",
        "--training.batch_size", "2", "--training.steps", "2", "--optim.lr", "1e-3",
        "--output.dir", str(tmp_path / "run"), "--output.name", NAME, "--output.progress", "false",
        "--output.comfyui", str(comfy.base_dir),
    ]  # fmt: skip
    assert main(argv) == 0
    installed = comfy.models_dir / "t5_linearize" / NAME
    assert installed.read_bytes() == (tmp_path / "run" / NAME).read_bytes()

    import folder_paths

    from t5core.hosts.comfy import converted_layers, linearize

    assert NAME in folder_paths.get_filename_list("t5_linearize")
    model = load_diffusion_model(str(install["checkpoint"]))
    patched = linearize(model, installed)
    assert converted_layers(patched)
    batch = comfy_tiny.inputs(batch=2, latent_hw=(4, 6), text=8)
    out, softmax = comfy_tiny.run(patched, batch), comfy_tiny.run(model, batch)
    assert torch.isfinite(out).all() and not torch.equal(out, softmax)

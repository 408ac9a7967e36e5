"""Bases from ComfyUI's files and from the Hub cache: the same model as the diffusers folder, offline."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from testing.tolerances import FP8_RATIO, assert_close
from testing.trainer_assets import dequantized_fp8, scaled_fp8, write_comfyui
from trainer.cli import parse_args
from trainer.config import ModelConfig
from trainer.inputs.single_file import load_single_file_pipeline, load_text_encoder
from trainer.inputs.sources import bundled_prefix, find_text_parts
from trainer.model import load_base
from trainer.train import run

T5_TOKENS = 8


@pytest.fixture(scope="module", params=[True, False], ids=["bundled", "separate"])
def comfy_install(request, tmp_path_factory):
    """A ComfyUI-style folder (checkpoint with bundled text encoders, or separate files) and its reference."""
    return write_comfyui(tmp_path_factory.mktemp("comfy"), bundled=request.param)


def model_config(files, **changes) -> ModelConfig:
    return ModelConfig(**{"comfyui": str(files["comfyui"]), "config": str(files["configs"]), **changes})


def encode(pipe):
    return pipe.encode_prompt(
        prompt=["a red circle", "b"], prompt_2=None, prompt_3=None, do_classifier_free_guidance=False,
        max_sequence_length=T5_TOKENS,
    )  # fmt: skip


def test_comfyui_files_give_the_diffusers_model(comfy_install):
    from diffusers import StableDiffusion3Pipeline

    config = model_config(comfy_install)
    assert config.base == f"{comfy_install['comfyui']}/models/checkpoints/sd3.5_medium.safetensors"
    pipe = load_single_file_pipeline(find_text_parts(config, ""), load_base(config), dtype=torch.float32)
    reference = StableDiffusion3Pipeline.from_pretrained(comfy_install["reference"], local_files_only=True)
    for name in ("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3"):
        ours, theirs = getattr(pipe, name).state_dict(), getattr(reference, name).state_dict()
        assert ours.keys() == theirs.keys(), name
        for key, value in theirs.items():
            assert torch.equal(ours[key], value), f"{name}.{key}"
    with torch.no_grad():
        got, want = encode(pipe), encode(reference)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    # The same weights in separately allocated tensors: the pooled projection's matmul may differ by 1 ulp.
    torch.testing.assert_close(got[2], want[2], rtol=0, atol=1e-6)


def test_prompts_run_from_a_comfyui_folder_writes_weights(comfy_install, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle\na blue square\n")
    config = parse_args(
        [
            "--model.comfyui", str(comfy_install["comfyui"]), "--model.config", str(comfy_install["configs"]),
            "--data.source", "prompts", "--data.path", str(prompts), "--data.resolution", "32",
            "--data.buckets", "1:1", "--data.generate_steps", "2", "--data.max_sequence_length", str(T5_TOKENS),
            "--training.batch_size", "2", "--training.steps", "1", "--output.dir", str(tmp_path / "run"),
            "--output.progress", "false",
        ]
    )  # fmt: skip
    result = run(config)
    assert result.step == 1 and (tmp_path / "run" / "t5.safetensors").is_file()


def test_bare_names_resolve_in_the_comfyui_folder():
    config = ModelConfig(comfyui="/c/", base="sd3_medium.safetensors", t5xxl="t5xxl_fp8_e4m3fn.safetensors")
    assert config.base == "/c/models/checkpoints/sd3_medium.safetensors"
    assert config.t5xxl == "/c/models/text_encoders/t5xxl_fp8_e4m3fn.safetensors"
    assert ModelConfig(comfyui="/c", base="/x/y.safetensors", clip_l="/z/l.safetensors").clip_l == "/z/l.safetensors"


@pytest.fixture
def separate(tmp_path):
    return write_comfyui(tmp_path, bundled=False)


def test_missing_checkpoint_names_the_folder(separate):
    with pytest.raises(FileNotFoundError, match=r"no checkpoint sd3\.5_large\.safetensors in .*models/checkpoints"):
        load_base(model_config(separate, base="sd3.5_large.safetensors"))


def test_missing_text_encoder_names_what_was_looked_for(separate):
    (separate["comfyui"] / "models" / "text_encoders" / "t5xxl_fp16.safetensors").unlink()
    with pytest.raises(
        FileNotFoundError,
        match=r"none of t5xxl_fp16\.safetensors, t5xxl_fp8_e4m3fn\.safetensors, t5xxl_fp8_e4m3fn_scaled",
    ):
        find_text_parts(model_config(separate), "")
    config = ModelConfig(base=str(separate["checkpoint"]), config=str(separate["configs"]))
    with pytest.raises(FileNotFoundError, match=r"no bundled clip_l text encoder\. Give its file with --model\.clip_l"):
        find_text_parts(config, "")


def test_a_scaled_fp8_t5_file_is_found_in_the_comfyui_folder(separate):
    encoders = separate["comfyui"] / "models" / "text_encoders"
    (encoders / "t5xxl_fp16.safetensors").rename(encoders / "t5xxl_fp8_e4m3fn_scaled.safetensors")
    assert (
        find_text_parts(model_config(separate), "").encoders["t5xxl"]
        == encoders / "t5xxl_fp8_e4m3fn_scaled.safetensors"
    )


def test_tokenizers_need_a_comfyui_folder(separate):
    encoders = separate["comfyui"] / "models" / "text_encoders"
    flags = {role: str(encoders / f"{role}.safetensors") for role in ("clip_l", "clip_g")}
    config = ModelConfig(
        base=str(separate["checkpoint"]), config=str(separate["configs"]),
        t5xxl=str(encoders / "t5xxl_fp16.safetensors"), **flags,
    )  # fmt: skip
    with pytest.raises(FileNotFoundError, match=r"needs the CLIP and T5 tokenizers: give your ComfyUI folder"):
        find_text_parts(config, "")
    shutil.rmtree(separate["comfyui"] / "comfy" / "text_encoders")
    with pytest.raises(FileNotFoundError, match=r"no tokenizer folder .*t5_tokenizer"):
        find_text_parts(model_config(separate), "")


def test_fp8_t5_is_upcast(tmp_path, caplog):
    files = write_comfyui(tmp_path, bundled=False, t5_dtype=torch.float8_e4m3fn)
    fp8 = files["comfyui"] / "models" / "text_encoders" / "t5xxl_fp8_e4m3fn.safetensors"
    config = model_config(files)
    with caplog.at_level(logging.INFO, logger="trainer.inputs.fp8"):
        pipe = load_single_file_pipeline(find_text_parts(config, ""), load_base(config), dtype=torch.float32)
    assert "holds fp8 t5xxl weights; upcasting them to torch.float32" in caplog.text
    expected = load_file(str(fp8))["shared.weight"].float()
    assert torch.equal(pipe.text_encoder_3.shared.weight, expected)


@pytest.mark.parametrize("role", ["clip_l", "t5xxl"])
def test_a_scaled_fp8_text_encoder_loads_dequantized_with_its_scales(comfy_install, role, tmp_path):
    """ComfyUI's scaled fp8, in its own file (`t5xxl_fp8_e4m3fn_scaled`) or bundled in the checkpoint
    (`sd3.5_large_fp8_scaled`): every weight is the fp8 value times its scale, bit for bit, and the encoder
    computes what the unquantized one does within fp8 rounding."""
    from transformers import CLIPTextModel, T5EncoderModel

    bundled = any(key.startswith(bundled_prefix(role)) for key in load_file(str(comfy_install["checkpoint"])))
    if bundled:
        source, prefix = comfy_install["checkpoint"], bundled_prefix(role)
    else:
        name = "t5xxl_fp16.safetensors" if role == "t5xxl" else f"{role}.safetensors"
        source, prefix = comfy_install["comfyui"] / "models" / "text_encoders" / name, ""
    tensors = load_file(str(source))
    scaled = scaled_fp8({key: value for key, value in tensors.items() if key.startswith(prefix)}, prefix=prefix)
    path = tmp_path / f"{role}_fp8_scaled.safetensors"
    save_file({**tensors, **scaled}, str(path))
    encoder = load_text_encoder(path, role, configs=comfy_install["configs"], dtype=torch.float32)
    state = encoder.state_dict()
    expected = {key.removeprefix(prefix): value for key, value in dequantized_fp8(scaled).items()}
    assert any(value.dtype == torch.float8_e4m3fn for value in scaled.values())
    for key, value in expected.items():
        assert state[key].dtype == torch.float32 and torch.equal(state[key], value), key
    cls, subfolder = (T5EncoderModel, "text_encoder_3") if role == "t5xxl" else (CLIPTextModel, "text_encoder")
    reference = cls.from_pretrained(comfy_install["reference"] / subfolder, local_files_only=True).eval()
    tokens = torch.randint(0, reference.config.vocab_size, (2, T5_TOKENS), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = encoder(tokens).last_hidden_state, reference(tokens).last_hidden_state
    assert_close(f"scaled fp8 {role}", want, got, FP8_RATIO)


def _hub_cache(root, reference, repo_id: str) -> str:
    """`reference` as a Hub repo snapshot in a Hugging Face cache under `root` (HF_HOME)."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = root / "hub" / f"models--{repo_id.replace('/', '--')}"
    shutil.copytree(reference, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return commit


REPO_ROOT = Path(__file__).resolve().parents[2]

HUB_SCRIPT = textwrap.dedent(
    """
    import sys
    from trainer.config import ModelConfig
    from trainer.model import load_base
    from trainer.inputs.sources import find_text_parts
    config = ModelConfig(base=sys.argv[1], revision=sys.argv[2])
    try:
        load_base(config)
        print("pipeline", find_text_parts(config, "").folder.name)
    except (FileNotFoundError, PermissionError) as error:
        print("error", error)
    """
)


def test_hub_repo_loads_from_the_offline_cache(tmp_path):
    files = write_comfyui(tmp_path / "assets", bundled=True)
    commit = _hub_cache(tmp_path / "hf", files["reference"], "tiny/sd3")
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)

    def call(repo_id: str, revision: str = "") -> str:
        done = subprocess.run(
            [sys.executable, "-c", HUB_SCRIPT, repo_id, revision], env=env, capture_output=True, text=True, check=True
        )
        return done.stdout.strip().splitlines()[-1]

    assert call("tiny/sd3") == f"pipeline {commit}"
    assert call("tiny/sd3", commit) == f"pipeline {commit}"
    missing = call("tiny/other")
    assert missing.startswith("error tiny/other@main is not in the Hugging Face cache") and "HF_HUB_OFFLINE" in missing


def test_a_prompts_run_from_a_hub_repo_id_finishes_offline(tmp_path):
    """`trainer/run.py --model.base owner/name` end to end from the cache, model card included."""
    files = write_comfyui(tmp_path / "assets", bundled=True)
    _hub_cache(tmp_path / "hf", files["reference"], "tiny/sd3")
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle\na blue square\n")
    out = tmp_path / "run"
    command = [
        sys.executable, "trainer/run.py", "--model.base", "tiny/sd3",
        "--data.source", "prompts", "--data.path", str(prompts), "--data.resolution", "32",
        "--data.buckets", "1:1", "--data.generate_steps", "2", "--data.max_sequence_length", str(T5_TOKENS),
        "--training.batch_size", "2", "--training.steps", "1", "--output.dir", str(out), "--output.progress", "false",
    ]  # fmt: skip
    done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (out / "t5.safetensors").is_file()
    card = (out / "README.md").read_text()
    assert "transformer/diffusion_pytorch_model.safetensors" in card

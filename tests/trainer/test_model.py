"""Base loading: diffusers folders, single-file SD3 checkpoints with local configs, shipped configs."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from t5core.hosts.diffusers import arch_of
from t5core.sd3_keys import diffusers_to_sd3, sd3_to_diffusers
from testing.models import tiny_inputs
from testing.tolerances import FP8_RATIO, assert_close
from testing.trainer_assets import dequantized_fp8, scaled_fp8, trainer_transformer, write_base
from trainer.config import ModelConfig
from trainer.model import CONFIGS_DIR, base_checkpoint_dtype, base_fingerprint, load_base, shipped_config

PREFIX = "model.diffusion_model."


@pytest.fixture(scope="module")
def single_file(tmp_path_factory):
    """The tiny transformer as a ComfyUI-style single file (SD3 naming, diffusion-model prefix)."""
    root = tmp_path_factory.mktemp("single")
    model = trainer_transformer()
    state = diffusers_to_sd3(model.state_dict(), arch_of(model))
    path = root / "tiny_sd35.safetensors"
    save_file({PREFIX + key: value.contiguous() for key, value in state.items()}, str(path))
    return dict(path=path, model=model, config=write_base(root / "config"))


def test_single_file_loads_bit_exact_with_a_local_config(single_file):
    loaded = load_base(ModelConfig(base=str(single_file["path"]), config=str(single_file["config"])))
    expected = single_file["model"].state_dict()
    assert loaded.state_dict().keys() == expected.keys()
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, expected[key]), key


def test_a_plain_fp8_single_file_loads_its_values_upcast(single_file, tmp_path):
    """fp8 weights without scales are the values they hold: the model gets them in fp32 exactly."""
    model = single_file["model"]
    state = diffusers_to_sd3(model.state_dict(), arch_of(model))
    fp8 = {PREFIX + key: value.to(torch.float8_e4m3fn).contiguous() for key, value in state.items()}
    path = tmp_path / "tiny_sd35_fp8.safetensors"
    save_file(fp8, str(path))
    loaded = load_base(ModelConfig(base=str(path), config=str(single_file["config"])))
    assert base_checkpoint_dtype(ModelConfig(base=str(path))) == torch.bfloat16
    expected = {key: value.to(torch.float8_e4m3fn).float() for key, value in model.state_dict().items()}
    for key, value in loaded.state_dict().items():
        assert value.dtype == torch.float32 and torch.equal(value, expected[key]), key


@pytest.fixture
def scaled(single_file):
    """The tiny transformer's single file quantized as ComfyUI's scaled fp8, as a dict to save."""
    model = single_file["model"]
    state = diffusers_to_sd3(model.state_dict(), arch_of(model))
    return scaled_fp8({PREFIX + key: value.contiguous() for key, value in state.items()}, prefix=PREFIX)


def test_a_scaled_fp8_single_file_loads_dequantized_with_its_scales(single_file, scaled, tmp_path):
    """ComfyUI's scaled fp8 (`*_fp8_scaled`): every parameter is the fp8 value times its scale, bit for bit,
    and the model computes what the unquantized one does within fp8 rounding."""
    path = tmp_path / "tiny_sd35_fp8_scaled.safetensors"
    save_file(scaled, str(path))
    loaded = load_base(ModelConfig(base=str(path), config=str(single_file["config"])))
    model = single_file["model"]
    reference = {key.removeprefix(PREFIX): value for key, value in dequantized_fp8(scaled).items()}
    expected = sd3_to_diffusers(reference, arch_of(model))
    assert loaded.state_dict().keys() == expected.keys()
    for key, value in loaded.state_dict().items():
        assert value.dtype == torch.float32 and torch.equal(value, expected[key]), key
    inputs = tiny_inputs(latent_hw=(8, 12))
    with torch.no_grad():
        assert_close("scaled fp8 output", model(**inputs).sample, loaded(**inputs).sample, FP8_RATIO)
    # fp8 values times float32 scales need float32 deltas: bfloat16 would round unchanged weights into deltas
    assert base_checkpoint_dtype(ModelConfig(base=str(path))) == torch.float32
    assert any(value.bfloat16().float().ne(value).any() for value in loaded.state_dict().values())
    # the fingerprint reads signs, which fp8 rounding keeps: the unquantized model's
    assert base_fingerprint(loaded, arch_of(loaded)) == base_fingerprint(model, arch_of(model))


def test_a_scaled_fp8_weight_without_its_scale_names_the_tensor_and_the_file(single_file, scaled, tmp_path):
    del scaled[PREFIX + "joint_blocks.0.context_block.mlp.fc2.scale_weight"]
    path = tmp_path / "broken_fp8_scaled.safetensors"
    save_file(scaled, str(path))
    match = r"broken_fp8_scaled\.safetensors: the fp8 tensor joint_blocks\.0\.context_block\.mlp\.fc2\.weight has no"
    with pytest.raises(ValueError, match=match):
        load_base(ModelConfig(base=str(path), config=str(single_file["config"])))


def test_diffusers_folder_loads(single_file):
    loaded = load_base(ModelConfig(base=str(single_file["config"])))
    assert torch.equal(loaded.proj_out.weight, single_file["model"].proj_out.weight)


def test_single_file_without_a_matching_shipped_config(single_file):
    with pytest.raises(ValueError, match=r"has 2 blocks .* no shipped config .* Pass --model.config"):
        load_base(ModelConfig(base=str(single_file["path"])))


def _layout_file(path, depth, dual, qk_norm):
    """A checkpoint with an SD3 layout's key names (tiny tensors: only the names are read)."""
    keys = ["x_embedder.proj.weight"]
    for i in range(depth):
        keys.append(f"joint_blocks.{i}.x_block.attn.qkv.weight")
        if qk_norm:
            keys.append(f"joint_blocks.{i}.x_block.attn.ln_q.weight")
        if i in dual:
            keys.append(f"joint_blocks.{i}.x_block.attn2.qkv.weight")
    save_file({PREFIX + key: torch.zeros(1) for key in keys}, str(path))
    return path


@pytest.mark.parametrize(
    ("depth", "dual", "qk_norm", "expected"),
    [
        pytest.param(24, range(13), True, "sd3.5_medium", id="sd3.5-medium"),
        pytest.param(38, (), True, "sd3.5_large", id="sd3.5-large"),
        pytest.param(24, (), False, "sd3_medium", id="sd3-medium"),
    ],
)
def test_shipped_config_is_chosen_by_layout(tmp_path, depth, dual, qk_norm, expected):
    assert shipped_config(_layout_file(tmp_path / "m.safetensors", depth, dual, qk_norm)).name == expected


@pytest.mark.parametrize(
    ("name", "params"),
    [pytest.param("sd3.5_medium", 2_243_171_520, id="medium"), pytest.param("sd3.5_large", 8_056_627_520, id="large")],
)
def test_shipped_configs_build_the_published_models(name, params):
    from diffusers import SD3Transformer2DModel

    config = json.loads((CONFIGS_DIR / name / "config.json").read_text())
    with torch.device("meta"):
        model = SD3Transformer2DModel.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == params


def _dtypes_file(path, blocks: torch.dtype, *, other: torch.dtype = torch.float32):
    """A single file whose transformer blocks are in `blocks` and whose other tensors (embedders, a
    bundled text encoder) are larger and in `other`: only the blocks decide."""
    tensors = {
        PREFIX + "joint_blocks.0.x_block.attn.qkv.weight": torch.zeros(6, 4, dtype=blocks),
        PREFIX + "joint_blocks.1.context_block.mlp.fc1.weight": torch.zeros(8, 4, dtype=blocks),
        PREFIX + "x_embedder.proj.weight": torch.zeros(64, 64, dtype=other),
        "text_encoders.t5xxl.transformer.encoder.block.0.layer.0.SelfAttention.q.weight": torch.zeros(64, 64),
    }
    save_file(tensors, str(path))
    return path


@pytest.mark.parametrize(
    "stored, expected",
    [
        pytest.param(torch.float16, torch.float16, id="fp16"),
        pytest.param(torch.bfloat16, torch.bfloat16, id="bf16"),
        pytest.param(torch.float32, torch.float32, id="fp32"),
        pytest.param(torch.float8_e4m3fn, torch.bfloat16, id="fp8-as-bf16"),
        pytest.param(torch.float64, torch.float32, id="fp64-as-fp32"),
    ],
)
def test_the_base_checkpoints_precision_is_read_from_its_blocks(tmp_path, stored, expected):
    path = _dtypes_file(tmp_path / "base.safetensors", stored, other=torch.float32)
    assert base_checkpoint_dtype(ModelConfig(base=str(path))) == expected


def test_the_base_precision_of_a_diffusers_folder_and_of_the_toy(tmp_path):
    trainer_transformer().to(torch.bfloat16).save_pretrained(tmp_path / "pipeline" / "transformer")
    (tmp_path / "pipeline" / "model_index.json").write_text("{}")
    assert base_checkpoint_dtype(ModelConfig(base=str(tmp_path / "pipeline"))) == torch.bfloat16
    write_base(tmp_path / "fp32")
    assert base_checkpoint_dtype(ModelConfig(base=str(tmp_path / "fp32"))) == torch.float32
    # the toy's weights file is fp16 (sd3_testbed/weights/toy_sd35.json records the recipe's dtype)
    assert base_checkpoint_dtype(ModelConfig()) == torch.float16

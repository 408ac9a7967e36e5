"""The ComfyUI host (`t5core.hosts.comfy`) on a tiny SD3.5-Medium-like checkpoint, in real ComfyUI.

Runs when ComfyUI is found (tests/comfy_env.py), skips with the reason otherwise.
"""

from __future__ import annotations

import copy

import pytest
import torch

from t5core.weights import T5WeightsError
from tests import comfy_env
from tests.tiny_models import tiny_transformer

# The diffusers and ComfyUI models compute the same fp32 math in a different order (fused vs split
# qkv, text first vs last, different attention kernels); measured gaps are ~1e-6.
PARITY_ATOL = 1e-4

comfy = comfy_env.comfy  # the session's ComfyUI (a pytest fixture)


@pytest.fixture(scope="module")
def transformer():
    return tiny_transformer("comfy_sd35_medium_like")


@pytest.fixture(scope="module")
def checkpoint(comfy, transformer):
    return comfy_env.write_checkpoint(comfy.models_dir / "diffusion_models" / "tiny_sd35m.safetensors", transformer)


@pytest.fixture(scope="module")
def model(comfy, checkpoint):
    import comfy.sd

    return comfy.sd.load_diffusion_model(str(checkpoint))


@pytest.fixture(scope="module")
def arch(model):
    from t5core.hosts.comfy import arch_of

    return arch_of(model.get_model_object("diffusion_model"))


@pytest.fixture(scope="module")
def weights_all(comfy, arch):
    return comfy_env.write_t5_weights(
        comfy.models_dir / "t5_linearize" / "tiny_all.safetensors", arch, arch.attention_modules()
    )


def _inputs(batch: int = 2, latent_hw: tuple[int, int] = (12, 20), text: int = 7, seed: int = 3) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return dict(
        x=torch.randn(batch, 16, *latent_hw, generator=generator),
        context=torch.randn(batch, text, 32, generator=generator),
        pooled=torch.randn(batch, 64, generator=generator),
    )


def _predict(patcher, inputs: dict, sigma: float = 0.6) -> torch.Tensor:
    return comfy_env.predict(patcher, inputs["x"], sigma, inputs["context"], inputs["pooled"])


def _snapshot(patcher) -> dict:
    return {
        "object_patches": dict(patcher.object_patches),
        "patches": {key: list(value) for key, value in patcher.patches.items()},
        "wrappers": copy.copy(patcher.wrappers),
        "additional_models": dict(patcher.additional_models),
        "transformer_options": copy.deepcopy(patcher.model_options["transformer_options"]),
    }


def test_arch_of_reads_the_comfy_model(arch):
    assert (arch.depth, arch.heads, arch.head_dim, arch.dual_attention_layers, arch.qk_norm) == (2, 2, 64, (0,), True)


def test_joint_forward_without_t5_reproduces_the_stock_block_bit_for_bit(model):
    """Guards against upstream drift of `_block_mixing`: our orchestration with softmax kept must equal ComfyUI's."""
    from t5core.hosts.comfy import JointForward

    inputs = _inputs()
    reference = _predict(model, inputs)
    patched = model.clone()
    for index, block in enumerate(model.get_model_object("diffusion_model").joint_blocks):
        patched.add_object_patch(f"diffusion_model.joint_blocks.{index}.forward", JointForward(block))
    assert torch.equal(_predict(patched, inputs), reference)


@pytest.mark.parametrize(
    "layers, with_base",
    [
        pytest.param(None, False, id="all-modules"),
        pytest.param("paper", True, id="paper-with-base-tensors"),
        pytest.param("joint:1", False, id="last-joint-only"),
    ],
)
def test_parity_with_the_diffusers_host(comfy, model, transformer, arch, checkpoint, tmp_path, layers, with_base):
    """Same tiny weights, same T5 file: ComfyUI (text first) and diffusers (text last) agree."""
    from safetensors.torch import load_file

    from t5core.hosts import comfy as comfy_host
    from t5core.hosts import diffusers as diffusers_host

    base = None
    if with_base:
        state = load_file(str(checkpoint))
        generator = torch.Generator().manual_seed(5)
        keys = ("joint_blocks.1.x_block.attn.qkv.weight", "joint_blocks.0.x_block.attn2.proj.weight")
        base = {
            key: state[f"model.diffusion_model.{key}"]
            + 0.05 * torch.randn(state[f"model.diffusion_model.{key}"].shape, generator=generator)
            for key in keys
        }
    path = comfy_env.write_t5_weights(tmp_path / "t5.safetensors", arch, arch.attention_modules(), seed=11, base=base)
    inputs = _inputs(batch=2, latent_hw=(12, 20))
    sigma = 0.6

    comfy_out = _predict(comfy_host.linearize(model, path, layers), inputs, sigma)

    reference = copy.deepcopy(transformer)
    handle = diffusers_host.linearize(reference, layers, weights=path)
    with torch.no_grad():
        diffusers_out = reference(
            hidden_states=inputs["x"],
            encoder_hidden_states=inputs["context"],
            pooled_projections=inputs["pooled"],
            timestep=torch.full((2,), sigma * 1000),
        ).sample
    softmax_out = _predict(model, inputs, sigma)
    assert handle.config.layers == comfy_host.converted_layers(comfy_host.linearize(model, path, layers))
    assert (comfy_out - softmax_out).abs().max() > 1e-2, (
        "T5 attention must change the output for parity to mean anything"
    )
    torch.testing.assert_close(comfy_out, diffusers_out, atol=PARITY_ATOL, rtol=0)


def _checkpoint_state(checkpoint) -> dict[str, torch.Tensor]:
    """The unpatched weights, in ComfyUI's `diffusion_model.*` naming (the live modules may hold
    another clone's patched weights until ComfyUI loads a different clone)."""
    from safetensors.torch import load_file

    return {
        f"diffusion_model.{key.removeprefix('model.diffusion_model.')}": t
        for key, t in load_file(str(checkpoint)).items()
    }


def test_removing_the_patch_restores_bit_identical_output_and_leaves_the_original_untouched(
    model, arch, comfy, checkpoint
):
    from t5core.hosts import comfy as comfy_host

    generator = torch.Generator().manual_seed(2)
    original = _checkpoint_state(checkpoint)
    key = "joint_blocks.1.x_block.attn.qkv.weight"
    weight = original[f"diffusion_model.{key}"]
    base = {key: weight + torch.randn(weight.shape, generator=generator)}
    path = comfy_env.write_t5_weights(
        comfy.models_dir / "t5_linearize" / "undo.safetensors", arch, arch.attention_modules(), base=base
    )
    inputs = _inputs()
    before_patcher = _snapshot(model)
    reference = _predict(model, inputs)

    patched = comfy_host.linearize(model, path)
    converted = _predict(patched, inputs)
    restored = _predict(model, inputs)

    assert not torch.equal(converted, reference)
    assert torch.equal(restored, reference)
    assert _snapshot(model) == before_patcher
    after_state = model.model_state_dict()
    assert all(torch.equal(after_state[name], tensor) for name, tensor in original.items())
    blocks = model.get_model_object("diffusion_model").joint_blocks
    assert all(type(block).forward is block.forward.__func__ for block in blocks)
    assert comfy_host.converted_layers(model) == ()


def test_each_sample_is_independent_so_batched_and_split_cfg_agree(model, weights_all):
    """ComfyUI batches cond and uncond into one call, or splits them when memory is short."""
    from t5core.hosts.comfy import linearize

    patched = linearize(model, weights_all)
    inputs = _inputs(batch=2, text=9)
    batched = _predict(patched, inputs)
    for row in range(2):
        single = {name: tensor[row : row + 1] for name, tensor in inputs.items()}
        torch.testing.assert_close(_predict(patched, single), batched[row : row + 1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "latent_hw, text",
    [
        pytest.param((12, 20), 7, id="12x20-wide"),
        pytest.param((20, 12), 7, id="20x12-tall"),
        pytest.param((13, 21), 5, id="13x21-odd"),
        pytest.param((2, 30), 11, id="2x30-strip"),
        pytest.param((16, 16), 154, id="16x16-txt154"),
    ],
)
def test_any_aspect_ratio_and_text_length_runs(model, weights_all, latent_hw, text):
    from t5core.hosts.comfy import linearize

    inputs = _inputs(batch=1, latent_hw=latent_hw, text=text)
    out = _predict(linearize(model, weights_all), inputs)
    assert out.shape == (1, 16, *latent_hw)
    assert torch.isfinite(out).all()
    assert not torch.equal(out, _predict(model, inputs))


@pytest.mark.parametrize(
    "latent_hw, patch, grid",
    [
        pytest.param((128, 128), (2, 2), (64, 64), id="1024x1024"),
        pytest.param((96, 168), (2, 2), (48, 84), id="1344x768"),
        pytest.param((256, 256), (2, 2), (128, 128), id="2048x2048"),
        pytest.param((13, 21), (2, 2), (7, 11), id="odd-latent-padded"),
    ],
)
def test_grid_wrapper_passes_the_token_grid_of_each_call(latent_hw, patch, grid):
    from t5core.hosts.comfy import KEY, _GridWrapper

    seen = {}

    def executor(x, t, c_concat, c_crossattn, control, transformer_options, **kwargs):
        seen.update(transformer_options)
        return x

    options = {"cond_or_uncond": [1, 0]}
    _GridWrapper(patch)(executor, torch.zeros(2, 16, *latent_hw), None, None, None, None, options)
    assert seen[KEY] == grid
    assert KEY not in options


@pytest.mark.parametrize("dtype", [pytest.param(torch.float16, id="fp16"), pytest.param(torch.bfloat16, id="bf16")])
def test_half_precision_models_run_and_stay_close_to_fp32(model, weights_all, dtype):
    from t5core.hosts.comfy import linearize

    inputs = _inputs(batch=1)
    reference = _predict(linearize(model, weights_all), inputs)
    half = model.clone()
    half.set_model_compute_dtype(dtype)
    out = _predict(linearize(half, weights_all), inputs)
    assert torch.isfinite(out).all()
    # Half-precision projections and MLPs (the T5 inner state stays fp32): a few percent of the output scale.
    assert (out - reference).abs().max() < 0.1 * reference.abs().max()


def test_lora_weight_patches_compose_with_t5(model, weights_all, checkpoint):
    """A LoRA-style diff patch before or after the node equals T5 on a model with those weights."""
    import comfy.sd

    from t5core.hosts.comfy import linearize

    key = "diffusion_model.joint_blocks.1.x_block.attn.qkv.weight"
    state = _checkpoint_state(checkpoint)
    weight = state[key]
    diff = 0.05 * torch.randn(weight.shape, generator=torch.Generator().manual_seed(4))
    inputs = _inputs(batch=1)

    lora_first = model.clone()
    lora_first.add_patches({key: (diff,)}, strength_patch=1.0)
    before = _predict(linearize(lora_first, weights_all), inputs)
    lora_after = linearize(model, weights_all)
    lora_after.add_patches({key: (diff,)}, strength_patch=1.0)
    after = _predict(lora_after, inputs)

    state[key] = weight + diff
    merged_model = comfy.sd.load_diffusion_model_state_dict(
        {k.removeprefix("diffusion_model."): t for k, t in state.items()}
    )
    merged = _predict(linearize(merged_model, weights_all), inputs)
    assert not torch.equal(before, _predict(linearize(model, weights_all), inputs))
    torch.testing.assert_close(before, merged, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(after, merged, atol=1e-5, rtol=1e-5)


def test_attention_override_still_reaches_the_softmax_modules(model, weights_all):
    """Sage/Flash-style `optimized_attention_override` keeps working for modules left softmax."""
    from t5core.hosts.comfy import linearize

    calls = []

    def override(func, *args, **kwargs):
        calls.append(args[0].shape[1])
        return func(*args, **kwargs)

    patched = linearize(model, weights_all, "joint:1")
    patched.model_options["transformer_options"]["optimized_attention_override"] = override
    inputs = _inputs(batch=1, latent_hw=(12, 20), text=7)
    _predict(patched, inputs)
    image, joint = 6 * 10, 6 * 10 + 7
    assert sorted(calls) == [image, joint]


def _tiny_flux(comfy):
    import comfy.model_management
    import comfy.model_patcher
    import comfy.supported_models

    config = comfy.supported_models.Flux(
        dict(
            image_model="flux",
            in_channels=16,
            out_channels=16,
            vec_in_dim=8,
            context_in_dim=8,
            hidden_size=32,
            mlp_ratio=2.0,
            num_heads=2,
            depth=1,
            depth_single_blocks=1,
            axes_dim=[4, 6, 6],
            theta=10000,
            patch_size=2,
            qkv_bias=True,
            guidance_embed=False,
        )
    )
    return comfy.model_patcher.ModelPatcher(
        config.get_model({}), comfy.model_management.get_torch_device(), comfy.model_management.unet_offload_device()
    )


def _other_arch_file(comfy, arch):
    from t5core.config import BaseArch

    large_like = BaseArch(depth=3, heads=3, head_dim=64, dual_attention_layers=(), qk_norm=True)
    return comfy_env.write_t5_weights(
        comfy.models_dir / "t5_linearize" / "large_like.safetensors", large_like, large_like.attention_modules()
    )


def _one_module_file(comfy, arch):
    return comfy_env.write_t5_weights(comfy.models_dir / "t5_linearize" / "one.safetensors", arch, ("blocks.1.attn",))


@pytest.mark.parametrize(
    "make_model, make_file, layers, error, match",
    [
        pytest.param(
            _tiny_flux, None, None, TypeError, r"converts SD3 / SD3\.5 models .* this MODEL is Flux", id="not-sd3"
        ),
        pytest.param(
            None,
            _other_arch_file,
            None,
            T5WeightsError,
            r"large_like\.safetensors: was made for .*3 blocks.* model is .*2 blocks",
            id="other-arch",
        ),
        pytest.param(
            None,
            _one_module_file,
            "all",
            T5WeightsError,
            r"one\.safetensors: .*also needs blocks\.0\.attn",
            id="layers-not-in-file",
        ),
        pytest.param(
            None,
            None,
            "joint:9",
            T5WeightsError,
            r"blocks\.9\.attn, which the model does not have",
            id="layers-not-in-model",
        ),
        pytest.param(None, None, "bogus", T5WeightsError, r"'bogus' is not understood", id="bad-layer-spec"),
        pytest.param(None, None, "none", ValueError, r"selects no attention module", id="empty-selection"),
    ],
)
def test_bad_inputs_give_clear_errors_and_leave_the_model_usable(
    comfy, model, arch, weights_all, make_model, make_file, layers, error, match
):
    from t5core.hosts.comfy import linearize

    target = make_model(comfy) if make_model else model
    path = make_file(comfy, arch) if make_file else weights_all
    inputs = _inputs(batch=1)
    reference = _predict(model, inputs)
    before = _snapshot(model)
    with pytest.raises(error, match=match):
        linearize(target, path, layers)
    assert _snapshot(model) == before
    assert torch.equal(_predict(model, inputs), reference)


def test_a_model_converted_twice_is_refused(model, weights_all):
    from t5core.hosts.comfy import linearize

    with pytest.raises(ValueError, match=r"already runs T5 attention on blocks\.0\.attn.*one T5 Linearize node"):
        linearize(linearize(model, weights_all), weights_all)


def test_base_tensors_that_do_not_fit_the_model_are_refused(comfy, model, arch):
    from t5core.hosts.comfy import linearize

    bad = {"joint_blocks.0.x_block.attn.qkv.weight": torch.zeros(3, 3)}
    path = comfy_env.write_t5_weights(
        comfy.models_dir / "t5_linearize" / "bad_base.safetensors", arch, ("blocks.1.attn",), base=bad
    )
    with pytest.raises(
        T5WeightsError,
        match=r"bad_base\.safetensors: base tensor 'joint_blocks\.0\.x_block\.attn\.qkv\.weight' "
        r"is \(3, 3\), the model's is \(384, 128\)",
    ):
        linearize(model, path)


def _sample(patcher, *, negative_tokens: int = 154, steps: int = 2, cfg: float = 4.5) -> torch.Tensor:
    """KSampler's own code path: euler / sgm_uniform, CFG. SD3 conditioning of different text lengths
    is never batched together (ComfyUI's SD3 `c_crossattn` is a `CONDRegular`), equal lengths are."""
    import nodes

    generator = torch.Generator().manual_seed(9)
    positive = [
        [torch.randn(1, 154, 32, generator=generator), {"pooled_output": torch.randn(1, 64, generator=generator)}]
    ]
    negative = [
        [
            torch.randn(1, negative_tokens, 32, generator=generator),
            {"pooled_output": torch.randn(1, 64, generator=generator)},
        ]
    ]
    latent = {"samples": torch.zeros(2, 16, 12, 20)}
    with torch.no_grad():
        out = nodes.common_ksampler(patcher, 42, steps, cfg, "euler", "sgm_uniform", positive, negative, latent)
    return out[0]["samples"]


def _count_chunks(patcher, seen: list[int]):
    import comfy.patcher_extension

    def spy(executor, *args, **kwargs):
        seen.append(len(args[5]["cond_or_uncond"]))
        return executor(*args, **kwargs)

    patcher.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.APPLY_MODEL, "test_spy", spy)
    return patcher


def test_sampling_with_cfg_batched_or_split_gives_the_same_latents(model, weights_all, monkeypatch):
    import comfy.model_management
    from comfy_extras.nodes_model_advanced import ModelSamplingSD3

    from t5core.hosts.comfy import linearize

    shifted = ModelSamplingSD3().patch(model, 3.0)[0]
    batched_chunks: list[int] = []
    batched = _sample(_count_chunks(linearize(shifted, weights_all), batched_chunks))
    split_chunks: list[int] = []
    monkeypatch.setattr(comfy.model_management, "get_free_memory", lambda *args, **kwargs: 0)
    split = _sample(_count_chunks(linearize(shifted, weights_all), split_chunks))
    assert set(batched_chunks) == {2} and set(split_chunks) == {1}
    assert torch.isfinite(batched).all()
    torch.testing.assert_close(split, batched, atol=1e-4, rtol=1e-4)


def test_skip_layer_guidance_composes_with_t5(model, weights_all):
    from comfy_extras.nodes_sd3 import SkipLayerGuidanceSD3

    from t5core.hosts.comfy import linearize

    converted = linearize(model, weights_all)
    guided = SkipLayerGuidanceSD3.execute(converted, layers="0", scale=3.0, start_percent=0.0, end_percent=1.0).result[
        0
    ]
    plain, with_slg = _sample(converted, negative_tokens=77), _sample(guided, negative_tokens=77)
    assert torch.isfinite(with_slg).all()
    assert not torch.equal(plain, with_slg)


@pytest.fixture(scope="module")
def large_canvas_model(comfy):
    """The tiny preset with a 128 x 128 position-embedding canvas, so 2048 x 2048 images fit."""
    from comfy.sd import load_diffusion_model
    from diffusers import SD3Transformer2DModel

    from tests.tiny_models import tiny_config

    torch.manual_seed(0)
    transformer = SD3Transformer2DModel(**{**tiny_config("comfy_sd35_medium_like"), "pos_embed_max_size": 128}).eval()
    path = comfy_env.write_checkpoint(comfy.models_dir / "diffusion_models" / "tiny_canvas128.safetensors", transformer)
    return load_diffusion_model(str(path))


@pytest.mark.parametrize(
    "latent_hw",
    [
        pytest.param((128, 128), id="1024x1024"),
        pytest.param((96, 168), id="1344x768"),
        pytest.param((256, 256), id="2048x2048"),
    ],
)
def test_full_size_resolutions_run_with_every_attention_converted(large_canvas_model, weights_all, latent_hw):
    from t5core.hosts.comfy import linearize

    inputs = _inputs(batch=1, latent_hw=latent_hw, text=154)
    out = _predict(linearize(large_canvas_model, weights_all), inputs)
    assert out.shape == (1, 16, *latent_hw)
    assert torch.isfinite(out).all()

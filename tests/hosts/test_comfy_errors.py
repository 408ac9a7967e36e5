"""The ComfyUI host's errors: each bad input names the problem and the fix, and leaves the incoming
model exactly as it was.

Runs when ComfyUI is found (testing/comfy_env.py), skips with the reason otherwise.
"""

from __future__ import annotations

import pytest
import torch

from t5core.weights import T5WeightsError
from testing import comfy_tiny


def _tiny_flux(comfy):
    """A non-SD3 MODEL: a one-block Flux with random weights."""
    import dataclasses

    import comfy.ldm.flux.model
    import comfy.model_management
    import comfy.model_patcher
    import comfy.supported_models

    unet_config = dict(
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
    # ComfyUI 0.33 added the required FluxParams field txt_ids_dims (which text-id axes carry positions).
    if "txt_ids_dims" in {field.name for field in dataclasses.fields(comfy.ldm.flux.model.FluxParams)}:
        unet_config["txt_ids_dims"] = []
    config = comfy.supported_models.Flux(unet_config)
    return comfy.model_patcher.ModelPatcher(
        config.get_model({}), comfy.model_management.get_torch_device(), comfy.model_management.unet_offload_device()
    )


def _other_arch_file(comfy, arch):
    from t5core.config import BaseArch

    large_like = BaseArch(depth=3, heads=3, head_dim=64, dual_attention_layers=(), qk_norm=True)
    return comfy_tiny.write_t5_weights(
        comfy.models_dir / "t5_linearize" / "large_like.safetensors", large_like, large_like.attention_modules()
    )


def _one_module_file(comfy, arch):
    return comfy_tiny.write_t5_weights(comfy.models_dir / "t5_linearize" / "one.safetensors", arch, ("blocks.1.attn",))


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
    inputs = comfy_tiny.inputs(batch=1)
    reference = comfy_tiny.run(model, inputs)
    before = comfy_tiny.snapshot(model)
    with pytest.raises(error, match=match):
        linearize(target, path, layers=layers)
    assert comfy_tiny.snapshot(model) == before
    assert torch.equal(comfy_tiny.run(model, inputs), reference)


def test_a_model_converted_twice_is_refused(model, weights_all):
    from t5core.hosts.comfy import linearize

    with pytest.raises(ValueError, match=r"already runs T5 attention on blocks\.0\.attn.*one T5 Linearize node"):
        linearize(linearize(model, weights_all), weights_all)


def test_base_tensors_that_do_not_fit_the_model_are_refused(comfy, model, arch):
    from t5core.hosts.comfy import linearize

    bad = {"joint_blocks.0.x_block.attn.qkv.weight": torch.zeros(3, 3)}
    path = comfy_tiny.write_t5_weights(
        comfy.models_dir / "t5_linearize" / "bad_base.safetensors", arch, ("blocks.1.attn",), base=bad
    )
    with pytest.raises(
        T5WeightsError,
        match=r"bad_base\.safetensors: base tensor 'joint_blocks\.0\.x_block\.attn\.qkv\.weight' "
        r"is \(3, 3\), the model's is \(384, 128\)",
    ):
        linearize(model, path)


def test_a_base_tensor_for_a_buffer_is_refused(comfy, model, arch, checkpoint):
    from safetensors.torch import load_file

    from t5core.hosts.comfy import linearize

    pos_embed = load_file(str(checkpoint))["model.diffusion_model.pos_embed"]
    path = comfy_tiny.write_t5_weights(
        comfy.models_dir / "t5_linearize" / "buffer_base.safetensors",
        arch,
        ("blocks.1.attn",),
        base={"pos_embed": pos_embed},
    )
    before = comfy_tiny.snapshot(model)
    with pytest.raises(
        T5WeightsError, match=r"buffer_base\.safetensors: base tensor 'pos_embed' is not a trainable weight"
    ):
        linearize(model, path)
    assert comfy_tiny.snapshot(model) == before


def test_arch_of_names_what_it_got_and_what_it_wants(comfy, model):
    from t5core.hosts.comfy import arch_of

    diffusion = model.get_model_object("diffusion_model")
    expected = rf"expected a ComfyUI MODEL \(a ModelPatcher\); got {type(diffusion).__name__}\. .*not its diffusion"
    with pytest.raises(TypeError, match=expected):
        arch_of(diffusion)
    with pytest.raises(TypeError, match=r"converts SD3 / SD3\.5 models .* this MODEL is Flux"):
        arch_of(_tiny_flux(comfy))


def test_arguments_after_the_weights_are_keyword_only(model, weights_all):
    from t5core.hosts.comfy import linearize

    with pytest.raises(TypeError, match="positional"):
        linearize(model, weights_all, "all")

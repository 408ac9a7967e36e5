"""The ComfyUI host (`t5core.hosts.comfy`) on a tiny SD3.5-Medium-like checkpoint, in real ComfyUI:
exactness against stock ComfyUI and the diffusers host, undo, batching, resolutions, dtypes, the
file's `base.*` tensors and deltas on the model's weights, the base fingerprint.

Runs when ComfyUI is found (testing/comfy_env.py), skips with the reason otherwise.
"""

from __future__ import annotations

import copy
import logging
import sys

import pytest
import torch

from t5core.deltas import fingerprint
from testing import comfy_tiny
from testing.models import tiny_config

# The diffusers and ComfyUI models compute the same fp32 math in a different order (fused vs split
# qkv, text first vs last, different attention kernels); the gaps are ~1e-6.
PARITY_ATOL = 1e-4
QKV = "joint_blocks.1.x_block.attn.qkv.weight"
PROJ = "joint_blocks.0.x_block.attn2.proj.weight"
# plain torch parameters (mmdit's RMSNorm), which ComfyUI's weight patches do not always reach
LN_Q = "joint_blocks.1.x_block.attn.ln_q.weight"
LN_K_TEXT = "joint_blocks.0.context_block.attn.ln_k.weight"


def _changes(kind: str | None, checkpoint, seed: int) -> dict:
    """`write_t5_weights` arguments for a file that changes QKV, PROJ and both norm scales: `base.*`
    fine-tuned values (the stored ones plus noise), or deltas (QKV low rank in 3 parts, PROJ low rank,
    full diffs on the scales); none for None."""
    if kind is None:
        return {}
    original = comfy_tiny.checkpoint_state(checkpoint)
    shapes = {key: tuple(original[f"diffusion_model.{key}"].shape) for key in (QKV, PROJ, LN_Q, LN_K_TEXT)}
    if kind == "deltas":
        return {"deltas": comfy_tiny.seeded_deltas(shapes, low_rank=(QKV, PROJ), seed=seed, std=0.2)[0]}
    generator = torch.Generator().manual_seed(seed)
    return {
        "base": {
            key: original[f"diffusion_model.{key}"] + 0.05 * torch.randn(shape, generator=generator)
            for key, shape in shapes.items()
        }
    }


def test_arch_of_reads_the_comfy_model(arch):
    assert (arch.depth, arch.heads, arch.head_dim, arch.dual_attention_layers, arch.qk_norm) == (2, 2, 64, (0,), True)


def test_joint_forward_without_t5_reproduces_the_stock_block_bit_for_bit(model):
    """Guards against upstream drift of `_block_mixing`: our orchestration with softmax kept must equal ComfyUI's."""
    import comfy.patcher_extension

    from t5core.hosts.comfy import KEY, JointForward, Schedule

    inputs = comfy_tiny.inputs()
    reference = comfy_tiny.run(model, inputs)
    patched = model.clone()
    for index in range(len(model.get_model_object("diffusion_model").joint_blocks)):
        patched.add_object_patch(f"diffusion_model.joint_blocks.{index}.forward", JointForward(index))
    patched.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.APPLY_MODEL, KEY, Schedule())
    assert torch.equal(comfy_tiny.run(patched, inputs), reference)


@pytest.mark.parametrize(
    "layers, changes, merge",
    [
        pytest.param(None, None, None, id="all-modules"),
        pytest.param("paper", "base", None, id="paper-with-base-tensors"),
        pytest.param("paper", "deltas", None, id="paper-with-deltas"),
        pytest.param("joint:1", None, None, id="last-joint-only"),
        pytest.param(None, None, "cumulant", id="all-modules-hybrid"),
        pytest.param("paper", None, "learned", id="paper-hybrid-learned"),
    ],
)
def test_parity_with_the_diffusers_host(comfy, model, transformer, arch, checkpoint, tmp_path, layers, changes, merge):
    """Same tiny weights, same T5 file: ComfyUI (text first) and diffusers (text last) agree, for T5
    over all tokens and for hybrid joint attention (`merge` set), with the file's `base.*` tensors or
    deltas on the weights."""
    from t5core.hosts import comfy as comfy_host
    from t5core.hosts import diffusers as diffusers_host

    mode = {} if merge is None else {"joint_mode": "hybrid", "merge": merge}
    path = comfy_tiny.write_t5_weights(
        tmp_path / "t5.safetensors", arch, arch.attention_modules(), seed=11, **_changes(changes, checkpoint, 5), **mode
    )
    inputs = comfy_tiny.inputs(batch=2, latent_hw=(12, 20))
    sigma = 0.6

    comfy_out = comfy_tiny.run(comfy_host.linearize(model, path, layers=layers), inputs, sigma)

    reference = copy.deepcopy(transformer)
    handle = diffusers_host.linearize(reference, layers=layers, weights=path)
    with torch.no_grad():
        diffusers_out = reference(
            hidden_states=inputs["x"],
            encoder_hidden_states=inputs["context"],
            pooled_projections=inputs["pooled"],
            timestep=torch.full((2,), sigma * 1000),
        ).sample
    softmax_out = comfy_tiny.run(model, inputs, sigma)
    assert handle.config.layers == comfy_host.converted_layers(comfy_host.linearize(model, path, layers=layers))
    assert (comfy_out - softmax_out).abs().max() > 1e-2, (
        "T5 attention must change the output for parity to mean anything"
    )
    torch.testing.assert_close(comfy_out, diffusers_out, atol=PARITY_ATOL, rtol=0)


@pytest.mark.parametrize("changes", ["base", "deltas"])
def test_removing_the_patch_restores_bit_identical_output_and_leaves_the_original_untouched(
    model, arch, comfy, checkpoint, changes
):
    from t5core.hosts import comfy as comfy_host

    original = comfy_tiny.checkpoint_state(checkpoint)
    norm = model.get_model_object("diffusion_model").joint_blocks[1].x_block.attn.ln_q
    path = comfy_tiny.write_t5_weights(
        comfy.models_dir / "t5_linearize" / f"undo_{changes}.safetensors",
        arch,
        arch.attention_modules(),
        **_changes(changes, checkpoint, 2),
    )
    inputs = comfy_tiny.inputs()
    before_patcher = comfy_tiny.snapshot(model)
    reference = comfy_tiny.run(model, inputs)

    patched = comfy_host.linearize(model, path)
    converted = comfy_tiny.run(patched, inputs)
    restored = comfy_tiny.run(model, inputs)

    assert not torch.equal(converted, reference)
    assert torch.equal(restored, reference)
    assert comfy_tiny.snapshot(model) == before_patcher
    after_state = model.model_state_dict()
    assert all(torch.equal(after_state[name], tensor) for name, tensor in original.items())
    blocks = model.get_model_object("diffusion_model").joint_blocks
    assert all(type(block).forward is block.forward.__func__ for block in blocks)
    assert blocks[1].x_block.attn.ln_q is norm
    assert comfy_host.converted_layers(model) == ()


def test_each_sample_is_independent_so_batched_and_split_cfg_agree(model, weights_all):
    """ComfyUI batches cond and uncond into one call, or splits them when memory is short."""
    from t5core.hosts.comfy import linearize

    patched = linearize(model, weights_all)
    inputs = comfy_tiny.inputs(batch=2, text=9)
    batched = comfy_tiny.run(patched, inputs)
    for row in range(2):
        single = {name: tensor[row : row + 1] for name, tensor in inputs.items()}
        torch.testing.assert_close(comfy_tiny.run(patched, single), batched[row : row + 1], atol=1e-5, rtol=1e-5)


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

    inputs = comfy_tiny.inputs(batch=1, latent_hw=latent_hw, text=text)
    out = comfy_tiny.run(linearize(model, weights_all), inputs)
    assert out.shape == (1, 16, *latent_hw)
    assert torch.isfinite(out).all()
    assert not torch.equal(out, comfy_tiny.run(model, inputs))


@pytest.mark.parametrize(
    "latent_hw, patch, grid",
    [
        pytest.param((128, 128), (2, 2), (64, 64), id="1024x1024"),
        pytest.param((96, 168), (2, 2), (48, 84), id="1344x768"),
        pytest.param((256, 256), (2, 2), (128, 128), id="2048x2048"),
        pytest.param((13, 21), (2, 2), (7, 11), id="odd-latent-padded"),
    ],
)
def test_the_call_context_carries_each_calls_token_grid_and_the_running_blocks(latent_hw, patch, grid):
    from types import SimpleNamespace

    from t5core.hosts.comfy import KEY, CallContext, Schedule

    seen = {}
    blocks = torch.nn.ModuleList([torch.nn.Identity()])
    diffusion = SimpleNamespace(x_embedder=SimpleNamespace(patch_size=patch), joint_blocks=blocks)

    def executor(x, t, c_concat, c_crossattn, control, transformer_options, **kwargs):
        seen.update(transformer_options)
        return x

    executor.class_obj = SimpleNamespace(diffusion_model=diffusion, model_sampling=None)
    options = {"cond_or_uncond": [1, 0]}
    Schedule()(executor, torch.zeros(2, 16, *latent_hw), torch.ones(2), None, None, None, options)
    assert seen[KEY] == CallContext(grid, blocks) and seen[KEY].blocks is blocks
    assert KEY not in options


def test_the_patches_follow_a_model_that_comfyui_re_created(comfy, model, checkpoint, weights_all):
    """ComfyUI 0.33 can run a clone on a re-created model (`clone(disable_dynamic=True)` for hooks or
    torch.compile): the object patches are the same objects, the blocks are the new model's."""
    import comfy.sd

    from t5core.hosts.comfy import linearize

    recreated = comfy.sd.load_diffusion_model(str(checkpoint))
    with torch.no_grad():
        recreated.get_model_object("diffusion_model").joint_blocks[1].x_block.mlp.fc2.weight.mul_(1.5)
    expected = comfy_tiny.run(linearize(recreated, weights_all), comfy_tiny.inputs())

    patched = linearize(model, weights_all)
    # as ComfyUI 0.33 re-creates it (`clone(model_override=...)`): the new model with its own backups,
    # so that loading it records nothing in the backups of `model`, which later tests load
    moved = patched.clone()
    moved.model = recreated.model
    for name in ("backup", "backup_buffers", "object_patches_backup", "pinned"):
        if hasattr(recreated, name):
            setattr(moved, name, getattr(recreated, name))
    out = comfy_tiny.run(moved, comfy_tiny.inputs())
    assert not torch.equal(out, comfy_tiny.run(patched, comfy_tiny.inputs()))
    assert torch.equal(out, expected)


@pytest.mark.parametrize(
    "dtype",
    [
        pytest.param(torch.float32, id="fp32"),
        pytest.param(torch.bfloat16, id="bf16"),
        pytest.param(torch.float16, id="fp16"),
    ],
)
def test_base_tensors_land_on_their_fine_tuned_values_in_the_models_dtype(comfy, checkpoint, arch, tmp_path, dtype):
    """`base.*` become differences from the stored weights (so that LoRAs commute with them): loaded,
    the model holds the fine-tuned values in its own dtype, as if they had been stored (within one
    unit in the last place; a few fp16 elements are one unit off)."""
    import comfy.model_management
    import comfy.sd

    from t5core.hosts.comfy import linearize

    stored = comfy.sd.load_diffusion_model(str(checkpoint), model_options={"dtype": dtype})
    original = comfy_tiny.checkpoint_state(checkpoint)
    generator = torch.Generator().manual_seed(8)
    keys = ("joint_blocks.1.x_block.attn.qkv.weight", "joint_blocks.0.x_block.attn2.proj.weight")
    keys += ("joint_blocks.1.x_block.attn.ln_q.weight",)
    base = {
        key: original[f"diffusion_model.{key}"]
        + 0.1 * torch.randn(original[f"diffusion_model.{key}"].shape, generator=generator)
        for key in keys
    }
    path = comfy_tiny.write_t5_weights(tmp_path / "base.safetensors", arch, arch.attention_modules(), base=base)
    patched = linearize(stored, path)
    comfy.model_management.load_models_gpu([patched])
    live = patched.model.diffusion_model
    for key, value in base.items():
        assert live.get_parameter(key).dtype == dtype
        # stored + (fine-tuned - stored) is rounded in fp32, then to the dtype: at most one unit apart
        torch.testing.assert_close(live.get_parameter(key).cpu(), value.to(dtype), rtol=torch.finfo(dtype).eps, atol=0)


@pytest.mark.parametrize(
    "dtype",
    [
        pytest.param(torch.float32, id="fp32"),
        pytest.param(torch.bfloat16, id="bf16"),
        pytest.param(torch.float16, id="fp16"),
    ],
)
def test_deltas_add_to_the_stored_weights_in_the_models_dtype(comfy, checkpoint, arch, tmp_path, caplog, dtype):
    """Loaded, the model holds its stored weights plus the deltas (added in fp32, rounded once to its
    dtype; the patched layers and the replaced RMSNorm scale alike), and its summary line counts them.
    The stored weights are the checkpoint's in the model's dtype, so its fingerprint is the file's."""
    import comfy.model_management
    import comfy.sd

    from t5core.hosts.comfy import linearize

    stored = comfy.sd.load_diffusion_model(str(checkpoint), model_options={"dtype": dtype})
    original = comfy_tiny.checkpoint_state(checkpoint)
    shapes = {key: tuple(original[f"diffusion_model.{key}"].shape) for key in (QKV, PROJ, LN_Q)}
    deltas, dense = comfy_tiny.seeded_deltas(shapes, low_rank=(QKV,), seed=8, std=0.2)
    stamp = fingerprint({key.removeprefix("diffusion_model."): t for key, t in original.items()}, arch)
    path = comfy_tiny.write_t5_weights(
        tmp_path / "deltas.safetensors", arch, arch.attention_modules(), deltas=deltas, fingerprint=stamp
    )
    with caplog.at_level(logging.INFO, logger="t5core"):
        patched = linearize(stored, path)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert "3 deltas added (1 low rank, 2 full)" in caplog.text
    comfy.model_management.load_models_gpu([patched])
    live = patched.model.diffusion_model
    for key, delta in dense.items():
        expected = (original[f"diffusion_model.{key}"].to(dtype).float() + delta).to(dtype)
        assert live.get_parameter(key).dtype == dtype
        # ComfyUI's LoRA patch multiplies each part's factors, ours (the expectation) too, in fp32: a
        # sum rounded the other way is one unit in the last place
        torch.testing.assert_close(live.get_parameter(key).cpu(), expected, rtol=torch.finfo(dtype).eps, atol=0)


def test_a_scale_delta_adds_to_the_stored_value_while_an_earlier_prompts_replacement_is_installed(
    model, arch, checkpoint, tmp_path
):
    """ComfyUI leaves the last prompt's clone loaded, its replaced RMSNorm modules in place: the next
    conversion adds the delta to the stored scale, not to the replacement's (twice)."""
    import comfy.utils

    from t5core.hosts.comfy import linearize

    original = comfy_tiny.checkpoint_state(checkpoint)
    deltas, _ = comfy_tiny.seeded_deltas({LN_Q: tuple(original[f"diffusion_model.{LN_Q}"].shape)}, seed=3)
    path = comfy_tiny.write_t5_weights(tmp_path / "scale.safetensors", arch, arch.attention_modules(), deltas=deltas)
    inputs = comfy_tiny.inputs(batch=1)
    first = comfy_tiny.run(linearize(model, path), inputs)
    path_of_scale = "diffusion_model." + LN_Q.removesuffix(".weight")
    assert comfy.utils.get_attr(model.model, path_of_scale) is not model.get_model_object(path_of_scale), (
        "the first clone's replacement must still be installed for the test to mean anything"
    )
    assert torch.equal(comfy_tiny.run(linearize(model, path), inputs), first)


def test_a_file_made_for_another_base_warns_once_and_still_adds_its_deltas(
    comfy, model, arch, checkpoint, tmp_path, caplog
):
    from t5core.hosts.comfy import linearize

    original = comfy_tiny.checkpoint_state(checkpoint)
    theirs = fingerprint({key.removeprefix("diffusion_model."): t for key, t in original.items()}, arch)
    deltas, dense = comfy_tiny.seeded_deltas({PROJ: tuple(original[f"diffusion_model.{PROJ}"].shape)}, low_rank=(PROJ,))
    path = comfy_tiny.write_t5_weights(
        tmp_path / "other.safetensors", arch, arch.attention_modules(), deltas=deltas, fingerprint="0123456789abcdef"
    )
    with caplog.at_level(logging.INFO, logger="t5core"):
        patched = linearize(model, path)
    (warning,) = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert "0123456789abcdef" in warning and theirs in warning and "adding its 1 deltas anyway" in warning
    assert "1 deltas added (1 low rank, 0 full)" in caplog.text and "base: not the file's base" in caplog.text
    comfy_tiny.run(patched, comfy_tiny.inputs(batch=1))
    live = patched.model.diffusion_model.get_parameter(PROJ).cpu()
    torch.testing.assert_close(live, original[f"diffusion_model.{PROJ}"] + dense[PROJ], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [pytest.param(torch.float16, id="fp16"), pytest.param(torch.bfloat16, id="bf16")])
def test_half_precision_models_run_and_stay_close_to_fp32(model, weights_all, dtype):
    from t5core.hosts.comfy import linearize

    inputs = comfy_tiny.inputs(batch=1)
    reference = comfy_tiny.run(linearize(model, weights_all), inputs)
    half = model.clone()
    half.set_model_compute_dtype(dtype)
    out = comfy_tiny.run(linearize(half, weights_all), inputs)
    assert torch.isfinite(out).all()
    # Half-precision projections and MLPs (the T5 inner state stays fp32): a few percent of the output scale.
    assert (out - reference).abs().max() < 0.1 * reference.abs().max()


@pytest.fixture(scope="module")
def large_canvas_model(comfy):
    """The tiny preset with a 128 x 128 position-embedding canvas, so 2048 x 2048 images fit."""
    from comfy.sd import load_diffusion_model
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(0)
    transformer = SD3Transformer2DModel(**{**tiny_config("comfy_sd35_medium_like"), "pos_embed_max_size": 128}).eval()
    path = comfy_tiny.write_checkpoint(
        comfy.models_dir / "diffusion_models" / "tiny_canvas128.safetensors", transformer
    )
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

    inputs = comfy_tiny.inputs(batch=1, latent_hw=latent_hw, text=154)
    out = comfy_tiny.run(linearize(large_canvas_model, weights_all), inputs)
    assert out.shape == (1, 16, *latent_hw)
    assert torch.isfinite(out).all()


def test_the_t5_modules_get_a_patcher_of_the_models_kind(model, weights_all, monkeypatch):
    """Under Dynamic VRAM (ComfyUI 0.33 on NVIDIA) the T5 patcher must be dynamic too: one plain
    patcher among the models to load makes ComfyUI free memory the old way, unloading the model."""
    import comfy.model_patcher

    from t5core.hosts.comfy import KEY, linearize

    class Dynamic(comfy.model_patcher.ModelPatcher):
        pass

    monkeypatch.setattr(comfy.model_patcher, "ModelPatcherDynamic", Dynamic, raising=False)
    plain = linearize(model, weights_all).additional_models[KEY][0]
    assert type(plain) is comfy.model_patcher.ModelPatcher

    dynamic_model = model.clone()
    monkeypatch.setattr(dynamic_model, "is_dynamic", lambda: True, raising=False)
    t5 = linearize(dynamic_model, weights_all).additional_models[KEY][0]
    assert type(t5) is Dynamic
    assert (t5.load_device, t5.offload_device) == (model.load_device, model.offload_device)


@pytest.mark.parametrize(("setting", "noted"), [(None, True), ("0", True), ("true", True), ("1", False)])
def test_on_a_linux_cpu_the_summary_names_the_huge_pages_setting_when_it_is_off(model, weights_all, monkeypatch,
                                                                                 setting, noted):  # fmt: skip
    """Without PyTorch's huge pages for CPU memory T5's chunk temporaries fault in page by page
    (docs/comfyui.md, "On a CPU"): the status says how to turn them on, and nothing once they are. torch takes
    only "1" as on ("true" is ignored with a warning), so the note stays for any other value."""
    from t5core.hosts.comfy import CPU_MEMORY_NOTE, linearize, summary

    if model.load_device.type != "cpu" or not sys.platform.startswith("linux"):
        pytest.skip("the note is for a Linux CPU")
    if setting is None:
        monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    else:
        monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", setting)
    assert (CPU_MEMORY_NOTE in summary(linearize(model, weights_all)).splitlines()) is noted


def test_the_schedule_maps_percents_to_noise_levels_as_comfyuis_controlnet_does(comfy):
    """With SD3's flow sampling (shift 3) 30% of sampling is sigma 0.875: T5 from there down to 0."""
    from types import SimpleNamespace

    import comfy.model_sampling

    from t5core.hosts.comfy import Schedule

    class Flow(comfy.model_sampling.ModelSamplingDiscreteFlow, comfy.model_sampling.CONST):
        pass

    sampling = Flow(SimpleNamespace(sampling_settings={"shift": 3.0, "multiplier": 1.0}))
    late = Schedule(0.3, 1.0)
    assert [late.runs_t5(sampling, sigma) for sigma in (1.0, 0.9, 0.876, 0.874, 0.5, 0.0)] == [
        False,
        False,
        False,
        True,
        True,
        True,
    ]
    middle = Schedule(0.3, 0.6)  # 60% is sigma 3 * 0.4 / (1 + 2 * 0.4) = 0.667
    assert [middle.runs_t5(sampling, sigma) for sigma in (0.9, 0.8, 0.67, 0.66)] == [False, True, True, False]
    assert all(Schedule().runs_t5(None, sigma) for sigma in (1.0, 0.0))


@pytest.mark.parametrize("percents", [(0.6, 0.4), (-0.1, 1.0), (0.0, 1.5)])
def test_a_schedule_out_of_order_or_range_is_refused(percents):
    from t5core.hosts.comfy_runtime import Schedule

    with pytest.raises(ValueError, match=r"must satisfy 0 <= start_percent <= end_percent <= 1"):
        Schedule(*percents)

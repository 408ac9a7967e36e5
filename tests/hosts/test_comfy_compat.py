"""The ComfyUI host beside what users combine it with: LoRA weight patches, attention overrides
(Sage / Flash nodes, `ModelAttentionBackend`), ModelSamplingSD3, skip-layer guidance, `TorchCompileModel`
and CFG batched or split by the sampler. LoRA files through a real server: tests/nodes/test_lora_order.py.

Runs when ComfyUI is found (testing/comfy_env.py), skips with the reason otherwise.
"""

from __future__ import annotations

import pytest
import torch

from testing import comfy_tiny
from testing.tolerances import relative_rms


def test_lora_weight_patches_compose_with_t5(model, weights_all, checkpoint):
    """A LoRA-style diff patch before or after the node equals T5 on a model with those weights."""
    import comfy.sd

    from t5core.hosts.comfy import linearize

    key = "diffusion_model.joint_blocks.1.x_block.attn.qkv.weight"
    state = comfy_tiny.checkpoint_state(checkpoint)
    weight = state[key]
    diff = 0.05 * torch.randn(weight.shape, generator=torch.Generator().manual_seed(4))
    inputs = comfy_tiny.inputs(batch=1)

    lora_first = model.clone()
    lora_first.add_patches({key: (diff,)}, strength_patch=1.0)
    before = comfy_tiny.run(linearize(lora_first, weights_all), inputs)
    lora_after = linearize(model, weights_all)
    lora_after.add_patches({key: (diff,)}, strength_patch=1.0)
    after = comfy_tiny.run(lora_after, inputs)

    state[key] = weight + diff
    merged_model = comfy.sd.load_diffusion_model_state_dict(
        {k.removeprefix("diffusion_model."): t for k, t in state.items()}
    )
    merged = comfy_tiny.run(linearize(merged_model, weights_all), inputs)
    assert not torch.equal(before, comfy_tiny.run(linearize(model, weights_all), inputs))
    torch.testing.assert_close(before, merged, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(after, merged, atol=1e-5, rtol=1e-5)


def test_attention_override_still_reaches_the_softmax_modules(model, weights_all):
    """Sage/Flash-style `optimized_attention_override` keeps working for modules left softmax."""
    from t5core.hosts.comfy import linearize

    calls = []

    def override(func, *args, **kwargs):
        calls.append(args[0].shape[1])
        return func(*args, **kwargs)

    patched = linearize(model, weights_all, layers="joint:1")
    patched.model_options["transformer_options"]["optimized_attention_override"] = override
    inputs = comfy_tiny.inputs(batch=1, latent_hw=(12, 20), text=7)
    comfy_tiny.run(patched, inputs)
    image, joint = 6 * 10, 6 * 10 + 7
    assert sorted(calls) == [image, joint]


def _sample(
    patcher, *, negative_tokens: int = 154, steps: int = 2, cfg: float = 4.5, latent_hw: tuple[int, int] = (12, 20)
) -> torch.Tensor:
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
    latent = {"samples": torch.zeros(2, 16, *latent_hw)}
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
    """SLG replaces whole blocks for its extra pass (ComfyUI's `dit` / `double_block` patch), T5 or not:
    with every module converted, skipping block 0 still changes the image (by about 0.63 relative)."""
    from comfy_extras.nodes_sd3 import SkipLayerGuidanceSD3

    from t5core.hosts.comfy import linearize

    converted = linearize(model, weights_all)
    guided = SkipLayerGuidanceSD3.execute(converted, layers="0", scale=3.0, start_percent=0.0, end_percent=1.0).result[
        0
    ]
    plain, with_slg = _sample(converted, negative_tokens=77), _sample(guided, negative_tokens=77)
    assert torch.isfinite(with_slg).all()
    assert relative_rms(plain, with_slg) > 1e-2


def test_model_attention_backend_before_t5_keeps_t5_on_the_converted_modules(model, weights_all, monkeypatch):
    """`ModelAttentionBackend` (ComfyUI 0.33) before T5 Linearize: the chosen attention runs the modules
    left softmax, T5 the converted ones."""
    import comfy.ldm.modules.attention as attention
    from comfy_extras import nodes_model_advanced

    from t5core.hosts.comfy import linearize

    if not hasattr(nodes_model_advanced, "ModelAttentionBackend"):
        pytest.skip("ModelAttentionBackend is new in ComfyUI 0.33; this tree does not have the node")
    chosen = attention.get_attention_function("pytorch")
    tokens = []

    def spy(q, *args, **kwargs):
        tokens.append(q.shape[1])
        return chosen(q, *args, **kwargs)

    monkeypatch.setitem(attention.REGISTERED_ATTENTION_FUNCTIONS, "pytorch", spy)
    backend = nodes_model_advanced.ModelAttentionBackend().patch(model, "pytorch attention")[0]
    inputs = comfy_tiny.inputs(batch=1, latent_hw=(12, 20), text=7)
    t5_alone = comfy_tiny.run(linearize(model, weights_all, layers="joint:1"), inputs)
    tokens.clear()
    out = comfy_tiny.run(linearize(backend, weights_all, layers="joint:1"), inputs)
    image, joint = 6 * 10, 6 * 10 + 7
    assert sorted(tokens) == [image, joint], "the chosen backend runs block 0 (joint and attn2), T5 block 1"
    # the same softmax attention as ComfyUI's default, possibly another kernel: about 3e-7 apart
    assert relative_rms(t5_alone, out) < 1e-5
    assert relative_rms(comfy_tiny.run(backend, inputs), out) > 1e-2


def _compiled_steps(patcher, seen: list[int]):
    """Spy on each model call: how many graphs torch.compile had made once it returned."""
    import comfy.patcher_extension
    from torch._dynamo.utils import counters

    def spy(executor, *args, **kwargs):
        out = executor(*args, **kwargs)
        seen.append(counters["stats"]["unique_graphs"])
        return out

    patcher.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.APPLY_MODEL, "test_compile_spy", spy)
    return patcher


@pytest.mark.parametrize(
    "compile_first", [pytest.param(False, id="compile-after-t5"), pytest.param(True, id="compile-before-t5")]
)
def test_torch_compile_model_runs_t5_like_eager_without_recompiling_per_step(model, weights_all, compile_first):
    """`TorchCompileModel` (inductor, on the CPU) after or before T5 Linearize: the eager latents, and
    every graph made on the first model call (no recompilation in the later steps). Slow: the first
    inductor compile of the session takes minutes on a 2-core CPU."""
    from comfy_extras.nodes_model_advanced import ModelSamplingSD3
    from comfy_extras.nodes_torch_compile import TorchCompileModel
    from torch._dynamo.utils import counters

    from t5core.hosts.comfy import linearize

    def compiled(patcher):
        return TorchCompileModel.execute(patcher, backend="inductor").result[0]

    shifted = ModelSamplingSD3().patch(model, 3.0)[0]
    eager = _sample(linearize(shifted, weights_all), steps=3)
    patcher = linearize(compiled(shifted), weights_all) if compile_first else compiled(linearize(shifted, weights_all))
    torch._dynamo.reset()
    before, seen = counters["stats"]["unique_graphs"], []
    try:
        out = _sample(_compiled_steps(patcher, seen), steps=3)
    finally:
        torch._dynamo.reset()
    assert len(seen) == 3 and seen[0] > before, f"graphs before sampling: {before}, after each step: {seen}"
    assert seen[-1] == seen[0], f"graphs after each step: {seen}"
    # inductor fuses and reorders the fp32 math: about 1e-6 apart
    assert relative_rms(eager, out) < 1e-5


def test_torch_compile_wrapper_makes_one_graph_and_one_recompile_for_new_latent_sizes(model, weights_all):
    """What `TorchCompileModel` installs (`set_torch_compile_wrapper`; the node adds only a clone and the
    choice of inductor or cudagraphs), after T5 Linearize, with a backend that counts the graphs it
    receives and runs each as it is (fast: no inductor). The sampler's 3 steps batch CFG's two halves
    (equal text lengths) into one model-call shape, and the T5 code breaks no graph, so the diffusion
    model compiles into exactly one graph, on the first step. The first new latent size recompiles
    once (dynamo makes the size dynamic), the next reuses that graph. The latents are eager's."""
    from comfy_api.torch_helpers import set_torch_compile_wrapper

    from t5core.hosts.comfy import linearize

    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    patched = linearize(model, weights_all)
    compiled = patched.clone()
    set_torch_compile_wrapper(model=compiled, backend=counting_backend)
    torch._dynamo.reset()
    try:
        for latent_hw, steps, expected_graphs in [((12, 20), 3, 1), ((16, 16), 1, 2), ((20, 12), 1, 2)]:
            out = _sample(compiled, steps=steps, latent_hw=latent_hw)
            assert len(graphs) == expected_graphs, f"latent {latent_hw}: {len(graphs)} graphs"
            # the graph replays eager's aten ops: 0 difference seen
            assert relative_rms(_sample(patched, steps=steps, latent_hw=latent_hw), out) < 1e-6
    finally:
        torch._dynamo.reset()

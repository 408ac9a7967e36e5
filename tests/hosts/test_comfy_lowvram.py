"""The ComfyUI host under a partial (low-VRAM) load: ComfyUI's own module-by-module loader handles
every T5 parameter, and the latents are those of a full load.

Runs when ComfyUI is found (testing/comfy_env.py), skips with the reason otherwise.
"""

from __future__ import annotations

import torch

from testing import comfy_tiny


def test_a_partial_load_handles_every_t5_parameter_and_gives_the_full_load_latents(model, weights_all):
    """With a weight budget of half the diffusion model, ComfyUI keeps part of the model on the offload
    device; the T5 modules fit, and ComfyUI must have loaded every one of their parameters (each is a
    parameter of a leaf module it loaded, and it counts all of their bytes). A parameter held beside
    child modules is skipped by that loader: on a GPU it would stay behind and be copied every call."""
    from t5core.hosts.comfy import KEY, linearize

    patched = linearize(model, weights_all)
    inputs = comfy_tiny.inputs()
    full = comfy_tiny.run(patched, inputs)
    budget = patched.model_size() // 2
    t5 = patched.additional_models[KEY][0]
    assert t5.model_size() < budget

    loaded = comfy_tiny.load_partially(patched, budget)
    try:
        assert patched.model.model_lowvram, "the budget should leave part of the diffusion model behind"
        for name, _ in t5.model.named_parameters():
            owner = t5.model.get_submodule(name.rpartition(".")[0])
            assert not list(owner.children()), f"{name} is not a leaf module's parameter"
            assert getattr(owner, "comfy_patched_weights", False), f"ComfyUI's partial load skipped {name}"
        assert t5.loaded_size() == t5.model_size()
        partial = comfy_tiny.run_loaded(patched, inputs)
    finally:
        comfy_tiny.unload(loaded)
    assert torch.equal(partial, full)

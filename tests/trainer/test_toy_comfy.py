"""The shipped toy teacher loads in ComfyUI as an SD3 diffusion model and computes what diffusers does.

Runs when ComfyUI is found (testing/comfy_env.py), skips with the reason otherwise.
"""

from __future__ import annotations

import torch

from sd3_testbed.data import embed_captions
from sd3_testbed.model import TOY_CONFIG, WEIGHTS_FILE, load_toy_base


def test_comfyui_loads_the_toy_as_sd3_and_matches_diffusers(comfy):
    import comfy.sd
    import comfy.utils

    patcher = comfy.sd.load_diffusion_model_state_dict(comfy.utils.load_torch_file(str(WEIGHTS_FILE)))
    assert type(patcher.model.model_config).__name__ == "SD3"
    network = patcher.model.diffusion_model.float().to("cpu")
    assert len(network.joint_blocks) == TOY_CONFIG["num_layers"]

    latents = torch.randn(2, 16, 12, 20, generator=torch.Generator().manual_seed(0))
    context, pooled = embed_captions(["small red circle top left", "large blue square center"])
    timestep = torch.tensor([500.0, 700.0])
    with torch.no_grad():
        theirs = network(latents, timestep, context=context, y=pooled)
        ours = load_toy_base()(
            hidden_states=latents,
            encoder_hidden_states=context,
            pooled_projections=pooled,
            timestep=timestep,
            return_dict=False,
        )[0]
    # Same fp16 weights computed in fp32 by two implementations: only summation order differs.
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)

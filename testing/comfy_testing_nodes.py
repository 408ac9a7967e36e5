"""A test-only ComfyUI node pack, loaded by testing/comfy_env.py and testing/comfy_server.py like any custom node.

CONDITIONING normally comes from CLIP-L, CLIP-G and T5-XXL text encoders (billions of parameters);
ComfyUI has no core node that makes it from nothing. `T5TestConditioning` makes seeded random text
features and pooled vectors of any size, so a whole prompt runs offline on tiny models.
"""

from __future__ import annotations

import torch
from comfy_api.latest import ComfyExtension, io


class T5TestConditioning(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="T5TestConditioning",
            category="T5/testing",
            description="Seeded random CONDITIONING (text features and pooled vector) for tests.",
            inputs=[
                io.Int.Input("seed", default=0, min=0, max=2**31 - 1),
                io.Int.Input("tokens", default=154, min=1, max=4096),
                io.Int.Input("context_dim", default=4096, min=1, max=8192),
                io.Int.Input("pooled_dim", default=2048, min=1, max=8192),
            ],
            outputs=[io.Conditioning.Output()],
        )

    @classmethod
    def execute(cls, seed: int, tokens: int, context_dim: int, pooled_dim: int) -> io.NodeOutput:
        generator = torch.Generator().manual_seed(seed)
        context = torch.randn(1, tokens, context_dim, generator=generator)
        pooled = torch.randn(1, pooled_dim, generator=generator)
        return io.NodeOutput([[context, {"pooled_output": pooled}]])


class TestingExtension(ComfyExtension):
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return [T5TestConditioning]


async def comfy_entrypoint() -> ComfyExtension:
    return TestingExtension()

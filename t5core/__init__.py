"""t5core: T5 attention with full weight inheritance for SD3 / SD3.5 (host-agnostic, pure PyTorch).

Hosts live in `t5core.hosts.diffusers` and `t5core.hosts.comfy` and are imported on demand, so
`import t5core` needs neither diffusers nor ComfyUI.
"""

from t5core.attention import T5Attention
from t5core.config import BaseArch, T5Config
from t5core.layers import resolve_layers
from t5core.weights import T5Weights, T5WeightsError

__all__ = ["BaseArch", "T5Attention", "T5Config", "T5Weights", "T5WeightsError", "resolve_layers"]

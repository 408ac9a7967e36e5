"""t5core: T5 attention with full weight inheritance for SD3 / SD3.5 (host-agnostic, pure PyTorch)."""

from t5core.attention import T5Attention
from t5core.config import BaseArch, T5Config
from t5core.layers import resolve_layers

__all__ = ["BaseArch", "T5Attention", "T5Config", "resolve_layers"]

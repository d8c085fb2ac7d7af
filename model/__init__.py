"""GPT with Origin (RoPE), ALiBi and CoCA attention. Pure PyTorch: no training, data or I/O code."""

from .attention import AttentionInputs
from .config import FLAVORS, ModelConfig, RopeScaling, count_parameters, flavor
from .gpt import GPT, KVCache
from .transforms import alibi_slopes

__all__ = [
    "GPT",
    "KVCache",
    "AttentionInputs",
    "ModelConfig",
    "RopeScaling",
    "FLAVORS",
    "flavor",
    "count_parameters",
    "alibi_slopes",
]

"""GPT with the attention designs of `model.designs` (Origin/RoPE, ALiBi, CoCA, ...). Pure PyTorch: no
training, data or I/O code."""

from .attention import AttentionInputs
from .config import FLAVORS, ModelConfig, RopeScaling, count_parameters, flavor
from .designs import DESIGNS, Design, design_of
from .gpt import GPT, KVCache

__all__ = [
    "GPT",
    "KVCache",
    "AttentionInputs",
    "ModelConfig",
    "RopeScaling",
    "FLAVORS",
    "flavor",
    "count_parameters",
    "DESIGNS",
    "Design",
    "design_of",
]

"""The layers model families are wired from (Llama, Gemma, Qwen, and the mixtures of
experts in ``moe.py``): ``Linear`` (quantized forms and the kernel each product takes,
``linear.py``, ``kernels.py``), ``Embed`` (``embed.py``), ``RMSNorm`` and soft-capping
(``norms.py``), rotary embeddings (``rope.py``). Where a model's weights are held for a
device is ``models.placement``'s."""

from .embed import Embed
from .kernels import KERNELS, KernelChoice, use_kernel
from .linear import FUSED, LAYER, ROWS, Linear, Packed, fp8_units, fuse_linears, make_linear
from .mlp import MLP
from .norms import RMSNorm, soft_cap
from .rope import apply_rope, rope_attention_factor, rope_inv_freq

__all__ = [
    "FUSED",
    "KERNELS",
    "LAYER",
    "ROWS",
    "Embed",
    "KernelChoice",
    "Linear",
    "MLP",
    "Packed",
    "RMSNorm",
    "apply_rope",
    "fp8_units",
    "fuse_linears",
    "make_linear",
    "rope_attention_factor",
    "rope_inv_freq",
    "soft_cap",
    "use_kernel",
]

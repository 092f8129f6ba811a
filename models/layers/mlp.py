"""The gated feed-forward block of the dense decoders (and a mixture's shared expert)."""

from __future__ import annotations

import jax
from flax import nnx

from paged_jax import linear

from .. import lora as _lora
from .kernels import kernel_platform
from .linear import fuse_linears, make_linear


class MLP(nnx.Module):
    """The gated feed-forward block: ``down(act(gate(x)) * up(x))``, ``x [T, E]`` to ``[T,
    E]`` through width ``intermediate`` (SwiGLU with ``act="silu"``, GeGLU with
    ``"gelu_tanh"``). ``lora``: its projections are LoRA targets (``gate_proj``,
    ``up_proj``, ``down_proj``; a mixture's shared expert's are not)."""

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        act: str,
        *,
        rngs: nnx.Rngs,
        dtype,
        param_dtype,
        lora: bool = True,
    ):
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.gate_proj = make_linear(hidden, intermediate, False, **kw)
        self.up_proj = make_linear(hidden, intermediate, False, **kw)
        self.down_proj = make_linear(intermediate, hidden, False, **kw)
        if lora:
            for name in ("gate_proj", "up_proj", "down_proj"):
                getattr(self, name).lora_targets = (name,)
        self.gelu = act == "gelu_tanh"

    def fuse_projections(self) -> bool:
        """In place: gate and up in one product (``fuse_linears``; ``gate_up_proj``
        replaces ``gate_proj`` and ``up_proj``). Returns whether they were fused."""
        if hasattr(self, "gate_up_proj"):
            return True
        fused = fuse_linears([self.gate_proj, self.up_proj])
        if fused is None:
            return False
        self.gate_up_proj = fused
        del self.gate_proj, self.up_proj
        return True

    def __call__(self, x_TE):
        if hasattr(self, "gate_up_proj"):  # fuse_projections: one product, split
            both = self.gate_up_proj(x_TE)
            F = self.gate_up_proj.parts[0]
            down = self.down_proj
            platform = kernel_platform("fp8_rows")
            if down.fp8_rows_kernel and platform and down.dtype is not None and both.ndim == 2:
                if _lora.current_mask() is None:  # (adapters need down's float input)
                    act = "gelu_tanh" if self.gelu else "silu"  # down's fp8 rows, in one kernel
                    rows = linear.fp8_rows(both, act=act, interpret=platform != "gpu")
                    return down(None, rows=rows)
            gate, up = both[:, :F], both[:, F:]
        else:
            gate, up = self.gate_proj(x_TE), self.up_proj(x_TE)
        gate = jax.nn.gelu(gate, approximate=True) if self.gelu else jax.nn.silu(gate)
        return self.down_proj(gate * up)

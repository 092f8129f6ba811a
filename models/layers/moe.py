"""A sparse mixture-of-experts block: a router picks each token's ``k`` experts of ``E``,
each a gated feed-forward block, and the token's output is their outputs weighted by the
router (Mixtral, Qwen2-MoE, Qwen3-MoE); Qwen2-MoE adds a shared expert every token
takes, scaled by a sigmoid gate of its own.

Shapes: T tokens, E hidden size (the model's; ``H`` here to keep ``E`` for experts where
it would clash: ``x [T, H]``), X experts, K experts a token, F an expert's width.

How the experts' products are computed is a static choice per platform (``EXPERT_WAYS``;
``expert_way`` overrides it while a block runs, for tests and A/B runs):

- ``"dense"``: every expert on every token, the unchosen ones weighted 0. X / K times the
  chosen products' FLOPs; each expert's weights read once a step, no gather, no sort.
- ``"gather"``: each token's K experts' weights gathered (``w[ids]``) and multiplied: the
  chosen FLOPs only, but T * K experts' bytes moved (fewer than X's when T * K < X, as in a
  decode step of a few sequences).
- ``"ragged"``: the (token, expert) pairs sorted by expert and multiplied as a grouped
  product (``jax.lax.ragged_dot``): the chosen FLOPs where the compiler has a grouped
  kernel (TPU); XLA's generic lowering pads it to the dense product.

All three give each token the same sum, up to the order of float additions.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp
from flax import nnx

from .linear import make_linear
from .mlp import MLP

EXPERT_PRODUCTS = ("dense", "gather", "ragged")
# The way each platform multiplies a step's tokens by its experts (see the module
# docstring). CPU: "dense" (docs/DECISIONS.md, "Expert products on CPU"); GPU and TPU
# wait for a device to time them (benchmarks/gpu_session.sh).
EXPERT_WAYS: dict[str, str] = {"cpu": "dense", "gpu": "ragged", "tpu": "ragged"}
_WAY: contextvars.ContextVar = contextvars.ContextVar("paged_jax_expert_way", default=None)


@contextlib.contextmanager
def expert_way(way: str):
    """Every sparse block traced inside computes its experts' products ``way`` (one of
    ``EXPERT_PRODUCTS``) whatever the platform. Raises ``ValueError`` for another."""
    if way not in EXPERT_PRODUCTS:
        raise ValueError(f"way: expected one of {EXPERT_PRODUCTS}, got {way!r}")
    token = _WAY.set(way)
    try:
        yield
    finally:
        _WAY.reset(token)


def current_way() -> str:
    """The way blocks traced now take: ``expert_way``'s, else ``EXPERT_WAYS``' entry for
    the platform computations go to ("dense" for one it does not name)."""
    from ..quantization import _target_platform

    return _WAY.get() or EXPERT_WAYS.get(_target_platform(), "dense")


def route(
    logits: jax.Array,  # f32[T, X]
    k: int,
    *,
    normalize: bool,
    scoring: str = "softmax",
) -> tuple[jax.Array, jax.Array]:  # (f32[T, K] weights, i32[T, K] experts)
    """Each token's ``k`` experts and their weights from the router's logits.

    ``scoring="softmax"``: the softmax over every expert, its ``k`` largest probabilities
    (ties to the lower index), divided by their sum when ``normalize`` (Mixtral always;
    Qwen's ``norm_topk_prob``). ``"topk_softmax"``: the ``k`` largest logits, then the
    softmax over those ``k`` only. Experts come in descending order of weight."""
    logits = logits.astype(jnp.float32)
    if scoring == "topk_softmax":
        top, ids = jax.lax.top_k(logits, k)
        return jax.nn.softmax(top, axis=-1), ids.astype(jnp.int32)
    if scoring != "softmax":
        raise ValueError(f"scoring: expected 'softmax' or 'topk_softmax', got {scoring!r}")
    probs = jax.nn.softmax(logits, axis=-1)
    top, ids = jax.lax.top_k(probs, k)
    if normalize:
        top = top / jnp.sum(top, axis=-1, keepdims=True)
    return top, ids.astype(jnp.int32)


def _act(h: jax.Array, gelu: bool) -> jax.Array:
    return jax.nn.gelu(h, approximate=True) if gelu else jax.nn.silu(h)


def expert_products(
    x: jax.Array,  # [T, H]
    weights: jax.Array,  # f32[T, K]
    ids: jax.Array,  # i32[T, K]
    gate: jax.Array,  # [X, H, F]
    up: jax.Array,  # [X, H, F]
    down: jax.Array,  # [X, F, H]
    *,
    way: str,
    gelu: bool = False,
) -> jax.Array:  # [T, H], x.dtype
    """``sum_k weights[t, k] * down_e(act(gate_e(x_t)) * up_e(x_t))`` with ``e = ids[t,
    k]``, each token's sum over its experts in the order given, computed ``way`` (one of
    ``EXPERT_PRODUCTS``; module docstring). Products in ``x``'s dtype at the highest
    precision, the weighted sum in f32."""
    hi = jax.lax.Precision.HIGHEST
    T, H = x.shape
    X = gate.shape[0]
    gate, up, down = (w.astype(x.dtype) for w in (gate, up, down))
    if way == "dense":
        g = jnp.einsum("th,xhf->txf", x, gate, precision=hi)
        u = jnp.einsum("th,xhf->txf", x, up, precision=hi)
        y = jnp.einsum("txf,xfh->txh", _act(g, gelu) * u, down, precision=hi)
        picked = jnp.take_along_axis(y, ids[:, :, None], axis=1)  # [T, K, H]
    elif way == "gather":
        g = jnp.einsum("th,tkhf->tkf", x, gate[ids], precision=hi)
        u = jnp.einsum("th,tkhf->tkf", x, up[ids], precision=hi)
        picked = jnp.einsum("tkf,tkfh->tkh", _act(g, gelu) * u, down[ids], precision=hi)
    elif way == "ragged":
        K = ids.shape[1]
        flat = ids.reshape(-1)
        order = jnp.argsort(flat, stable=True)  # the (token, choice) pairs by expert
        rows = x[order // K]  # [T * K, H]
        sizes = jnp.bincount(flat, length=X).astype(jnp.int32)
        g = jax.lax.ragged_dot(rows, gate, sizes, precision=hi)
        u = jax.lax.ragged_dot(rows, up, sizes, precision=hi)
        y = jax.lax.ragged_dot(_act(g, gelu) * u, down, sizes, precision=hi)
        back = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
        picked = y[back].reshape(T, K, H)
    else:
        raise ValueError(f"way: expected one of {EXPERT_PRODUCTS}, got {way!r}")
    out = jnp.einsum("tkh,tk->th", picked.astype(jnp.float32), weights, precision=hi)
    return out.astype(x.dtype)


class Router(nnx.Module):
    """The router's weight ``kernel [H, X]`` (``[L, H, X]`` in a layer stack), held in
    float and computed in f32 whatever the model's weights are quantized to."""

    def __init__(self, hidden: int, experts: int, *, rngs: nnx.Rngs, param_dtype):
        init = nnx.initializers.lecun_normal()
        self.kernel = nnx.Param(init(rngs.params(), (hidden, experts), param_dtype))

    def weight(self) -> jax.Array:  # [(L,) H, X]
        """The kernel as it is held (``Linear.weight``'s counterpart, for writers)."""
        return self.kernel[...]

    def __call__(self, x: jax.Array) -> jax.Array:  # [T, H] -> f32[T, X]
        w = self.kernel[...].astype(jnp.float32)
        return jnp.dot(x.astype(jnp.float32), w, precision=jax.lax.Precision.HIGHEST)


class Experts(nnx.Module):
    """``X`` gated feed-forward experts of width ``F``: ``gate_proj``, ``up_proj`` ``[X, H,
    F]`` and ``down_proj`` ``[X, F, H]`` (``[L, X, ...]`` in a layer stack), ``[in, out]``
    per expert as ``Linear`` holds its kernels."""

    def __init__(self, hidden: int, width: int, experts: int, *, rngs: nnx.Rngs, param_dtype):
        init = nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
        self.gate_proj = nnx.Param(init(rngs.params(), (experts, hidden, width), param_dtype))
        self.up_proj = nnx.Param(init(rngs.params(), (experts, hidden, width), param_dtype))
        self.down_proj = nnx.Param(init(rngs.params(), (experts, width, hidden), param_dtype))


class SparseMoE(nnx.Module):
    """A sparse mixture-of-experts block, ``x [T, H]`` to ``[T, H]``.

    ``gate`` (``Router``) scores the experts, ``route`` picks each token's ``k``,
    ``experts`` (``Experts``) are multiplied ``current_way()``; with
    ``shared_width`` > 0 a shared expert (``MLP`` of that width, not a LoRA target) adds
    ``sigmoid(shared_expert_gate(x)) * shared_expert(x)`` (Qwen2-MoE)."""

    def __init__(
        self,
        hidden: int,
        width: int,
        experts: int,
        k: int,
        *,
        normalize: bool,
        act: str,
        shared_width: int = 0,
        rngs: nnx.Rngs,
        dtype,
        param_dtype,
    ):
        self.gate = Router(hidden, experts, rngs=rngs, param_dtype=param_dtype)
        self.experts = Experts(hidden, width, experts, rngs=rngs, param_dtype=param_dtype)
        self.k, self.normalize, self.gelu = k, normalize, act == "gelu_tanh"
        self.dtype = dtype
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.shared_expert = (
            MLP(hidden, shared_width, act, lora=False, **kw) if shared_width else None
        )
        self.shared_expert_gate = make_linear(hidden, 1, False, **kw) if shared_width else None

    def fuse_projections(self) -> bool:
        """In place: the shared expert's gate and up in one product (``MLP.
        fuse_projections``); the experts' stay apart. Returns whether there was one to fuse."""
        return self.shared_expert is not None and self.shared_expert.fuse_projections()

    def choices(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``route`` of ``x [T, H]``: ``(f32[T, K] weights, i32[T, K] experts)``."""
        return route(self.gate(x), self.k, normalize=self.normalize)

    def __call__(self, x: jax.Array) -> jax.Array:
        weights, ids = self.choices(x)
        e = self.experts
        x = x if self.dtype is None else x.astype(self.dtype)
        out = expert_products(
            x,
            weights,
            ids,
            e.gate_proj[...],
            e.up_proj[...],
            e.down_proj[...],
            way=current_way(),
            gelu=self.gelu,
        )
        if self.shared_expert is not None:
            scale = jax.nn.sigmoid(self.shared_expert_gate(x).astype(jnp.float32))
            out = out + (scale * self.shared_expert(x).astype(jnp.float32)).astype(out.dtype)
        return out

"""A sparse mixture-of-experts block: a router picks each token's ``k`` experts of ``E``,
each a gated feed-forward block, and the token's output is their outputs weighted by the
router (Mixtral, Qwen2-MoE, Qwen3-MoE, GPT-OSS); Qwen2-MoE adds a shared expert every
token takes, scaled by a sigmoid gate of its own; GPT-OSS gives the router and the
experts' projections biases and clamps the experts' gated unit (``Glu``).

Shapes: T tokens, E hidden size (the model's; ``H`` here to keep ``E`` for experts where
it would clash: ``x [T, H]``), X experts, K experts a token, F an expert's width.

How the experts' products are computed is a static choice per platform (``EXPERT_WAYS``;
``expert_way`` overrides it while a model is held and its steps traced, for tests and A/B
runs):

- ``"packed"`` (CPU, where the C kernels build): the experts packed for the C kernel when
  the engine holds the model (``Experts.hold_packed``), the (token, expert) pairs sorted
  by expert and each expert's rows multiplied by its own weights (``packed_products``):
  the chosen FLOPs, and an expert no token chose is not read.
- ``"dense"``: every expert on every token, the unchosen ones weighted 0. X / K times the
  chosen products' FLOPs; each expert's weights read once a step, no gather, no sort.
- ``"gather"``: each token's K experts' weights gathered (``w[ids]``) and multiplied: the
  chosen FLOPs only, but T * K experts' bytes moved (fewer than X's when T * K < X, as in a
  decode step of a few sequences).
- ``"ragged"``: the (token, expert) pairs sorted by expert and multiplied as a grouped
  product (``jax.lax.ragged_dot``): the chosen FLOPs where the compiler has a grouped
  kernel (TPU); XLA's generic lowering pads it to the dense product.
- ``"pallas"``: the pairs laid out in tiles of one expert each (``paged_jax.kernels.
  _groups.expert_tiles``) and multiplied by the platform's Pallas grouped product
  (``kernels.gpu.grouped`` / ``kernels.tpu.grouped``, interpreted on CPU), each tile
  reading its expert's weights through the tile table: the chosen FLOPs and bytes, int8
  experts (scales per column) read as int8 (``pallas_products``).

All of them give each token the same sum, up to the order of float additions.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from paged_jax import linear

from ..quantization import dequantize_int4, int8_group, quantize_int4, quantize_int8
from .linear import LAYER, ROWS, Packed, layer_value, make_linear
from .mlp import MLP

EXPERT_PRODUCTS = ("packed", "dense", "gather", "ragged", "pallas")
# The way each platform multiplies a step's tokens by its experts (see the module
# docstring). CPU: "packed" (docs/DECISIONS.md, "Expert products on CPU"); GPU and TPU:
# "ragged" until a device times the ways (benchmarks/gpu_session.sh).
EXPERT_WAYS: dict[str, str] = {"cpu": "packed", "gpu": "ragged", "tpu": "ragged"}
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
    """The way models held and blocks traced now take: ``expert_way``'s, else
    ``EXPERT_WAYS``' entry for the platform computations go to ("dense" for one it does
    not name, and for "packed" where the C kernels are not available)."""
    from ..quantization import _target_platform

    way = _WAY.get() or EXPERT_WAYS.get(_target_platform(), "dense")
    return "dense" if way == "packed" and not linear.available() else way


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


class Glu(NamedTuple):
    """An expert's gated unit, ``g`` and ``u`` its gate's and up projection's outputs:
    ``act(g) * u`` with SiLU (or tanh GELU with ``gelu``); with ``limit`` (GPT-OSS), ``g``
    clamped to at most ``limit`` and ``u`` to ``[-limit, limit]``, then ``(u + 1) * g *
    sigmoid(alpha * g)``."""

    gelu: bool = False
    limit: float | None = None
    alpha: float = 1.702

    def __call__(self, g: jax.Array, u: jax.Array) -> jax.Array:
        if self.limit is not None:
            g = jnp.minimum(g, self.limit)
            u = jnp.clip(u, -self.limit, self.limit)
            return (u + 1) * (g * jax.nn.sigmoid(self.alpha * g))
        return (jax.nn.gelu(g, approximate=True) if self.gelu else jax.nn.silu(g)) * u


SWIGLU = Glu()  # SiLU(gate) * up: Mixtral's and Qwen's experts


def _dequantize(q: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """int8 experts ``q [X, in, out]`` times their scales: ``[X, in / G, out]`` (each
    group of G inputs) or ``[X, out]`` (each column), in ``dtype``."""
    if scale.ndim == q.ndim:
        scale = jnp.repeat(scale, q.shape[-2] // scale.shape[-2], axis=-2)
    else:
        scale = scale[..., None, :]
    return (q.astype(jnp.float32) * scale).astype(dtype)


class Biases(NamedTuple):
    """The experts' biases (GPT-OSS): ``gate`` and ``up`` ``[X, F]``, ``down`` ``[X, H]``."""

    gate: jax.Array
    up: jax.Array
    down: jax.Array

    def of(self, experts: jax.Array) -> Biases:
        """Each row's biases for the experts ``experts`` (any shape ``[...]``; an id past
        the last expert, a padding row's, takes zeros): ``[..., F]``, ``[..., H]``."""
        take = lambda b: jnp.take(b, experts, axis=0, mode="fill", fill_value=0)  # noqa: E731
        return Biases(take(self.gate), take(self.up), take(self.down))


def expert_products(
    x: jax.Array,  # [T, H]
    weights: jax.Array,  # f32[T, K]
    ids: jax.Array,  # i32[T, K]
    gate: jax.Array,  # [X, H, F]
    up: jax.Array,  # [X, H, F]
    down: jax.Array,  # [X, F, H]
    *,
    way: str,
    glu: Glu = SWIGLU,
    biases: Biases | None = None,
) -> jax.Array:  # [T, H], x.dtype
    """``sum_k weights[t, k] * down_e(glu(gate_e(x_t), up_e(x_t)))`` with ``e = ids[t,
    k]`` (each projection plus its bias where ``biases`` are given), each token's sum
    over its experts in the order given, computed ``way`` (one of ``EXPERT_PRODUCTS``;
    module docstring). Products in ``x``'s dtype at the highest precision, the weighted
    sum in f32."""
    hi = jax.lax.Precision.HIGHEST
    T, H = x.shape
    X = gate.shape[0]
    if way == "pallas":
        return pallas_products(x, weights, ids, gate, up, down, glu=glu, biases=biases)
    gate, up, down = (w.astype(x.dtype) for w in (gate, up, down))
    if biases is not None:
        biases = Biases(*(b.astype(x.dtype) for b in biases))
    if way == "dense":
        g = jnp.einsum("th,xhf->txf", x, gate, precision=hi)
        u = jnp.einsum("th,xhf->txf", x, up, precision=hi)
        if biases is not None:
            g, u = g + biases.gate[None], u + biases.up[None]
        y = jnp.einsum("txf,xfh->txh", glu(g, u), down, precision=hi)
        y = y if biases is None else y + biases.down[None]
        picked = jnp.take_along_axis(y, ids[:, :, None], axis=1)  # [T, K, H]
    elif way == "gather":
        g = jnp.einsum("th,tkhf->tkf", x, gate[ids], precision=hi)
        u = jnp.einsum("th,tkhf->tkf", x, up[ids], precision=hi)
        b = None if biases is None else biases.of(ids)
        if b is not None:
            g, u = g + b.gate, u + b.up
        picked = jnp.einsum("tkf,tkfh->tkh", glu(g, u), down[ids], precision=hi)
        picked = picked if b is None else picked + b.down
    elif way == "ragged":
        K = ids.shape[1]
        flat = ids.reshape(-1)
        order = jnp.argsort(flat, stable=True)  # the (token, choice) pairs by expert
        rows = x[order // K]  # [T * K, H]
        sizes = jnp.bincount(flat, length=X).astype(jnp.int32)
        # (16-bit rows at the default precision: their products are exact in f32 anyway,
        # and TPU's grouped kernel refuses bf16 operands at HIGHEST)
        rp = hi if x.dtype == jnp.float32 else jax.lax.Precision.DEFAULT
        g = jax.lax.ragged_dot(rows, gate, sizes, precision=rp)
        u = jax.lax.ragged_dot(rows, up, sizes, precision=rp)
        b = None if biases is None else biases.of(flat[order])
        if b is not None:
            g, u = g + b.gate, u + b.up
        y = jax.lax.ragged_dot(glu(g, u).astype(x.dtype), down, sizes, precision=rp)
        y = y if b is None else y + b.down
        back = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
        picked = y[back].reshape(T, K, H)
    else:
        raise ValueError(
            f"way: expected one of {EXPERT_PRODUCTS[1:]} (packed experts: packed_products), "
            f"got {way!r}"
        )
    out = jnp.einsum("tkh,tk->th", picked.astype(jnp.float32), weights, precision=hi)
    return out.astype(x.dtype)


def _split_by_mesh() -> bool:
    """Whether the mesh set now splits a step's computations (tensor or data parallel)."""
    from paged_jax import sharding

    return sharding.tensor_parallel_size() > 1 or sharding.data_parallel_size() > 1


def _block_m(pairs: int, experts: int, least: int) -> int:
    """A tile's rows for ``pairs`` pairs over ``experts`` experts: the pairs an expert
    gets on average, as a power of two from ``least`` up to 128 (a decode step's few
    rows an expert waste little of a tile; a prefill's many fill whole ones)."""
    mean = -(-pairs // experts)
    return min(128, max(least, 1 << max(0, (mean - 1).bit_length())))


def pallas_products(
    x: jax.Array,  # [T, H]
    weights: jax.Array,  # f32[T, K]
    ids: jax.Array,  # i32[T, K]; an id outside [0, X): a pair of no expert (weighed 0)
    gate: jax.Array,  # [X, H, F], float or int8 (with scales)
    up: jax.Array,  # [X, H, F], so
    down: jax.Array,  # [X, F, H], so
    *,
    glu: Glu = SWIGLU,
    biases: Biases | None = None,
    scales: tuple | None = None,  # int8 experts' f32 (gate [X, F], up [X, F], down [X, H])
    kernel: str | None = None,
) -> jax.Array:  # [T, H], x.dtype
    """``expert_products``' sum through a Pallas grouped product: the pairs laid out in
    ``block_m``-row tiles of one expert each (``expert_tiles``), then gate's and up's
    products, the gated unit and down's product over the tiles, each tile reading only its
    expert's weights. Float weights are read in ``x``'s dtype; int8 ones (``scales``: a
    scale per output column) as int8, their scales applied to the sums. ``kernel``:
    "gpu" (Triton) or "tpu" (Mosaic); default the platform computations go to, and on a
    CPU the GPU kernel interpreted."""
    from ..quantization import _target_platform

    platform = kernel or _target_platform()
    kernel = "tpu" if platform == "tpu" else "gpu" if platform in ("gpu", "cpu") else None
    if kernel is None:
        raise ValueError(f"kernel: expected 'gpu' or 'tpu', got {platform!r}")
    interpret = platform != _target_platform() or platform == "cpu"
    T, H = x.shape
    X, K = gate.shape[0], ids.shape[1]
    if scales is None:
        gate, up, down = (w.astype(x.dtype) for w in (gate, up, down))
        scales = (None, None, None)
    F = gate.shape[2]
    if platform != "tpu" and (H % 16 or F % 16):
        # Triton's blocks are powers of two of at least 16: pad H and F with zeros in the
        # step (a copy of the weights: a tiny test model's shapes, no real model's)
        h, f = -H % 16, -F % 16
        pad = lambda a, *widths: jnp.pad(a, [(0, 0)] * (a.ndim - len(widths)) + list(widths))  # noqa: E731
        x = pad(x, (0, h))
        gate, up, down = (
            pad(gate, (0, h), (0, f)),
            pad(up, (0, h), (0, f)),
            pad(down, (0, f), (0, h)),
        )
        if scales[0] is not None:
            scales = (pad(scales[0], (0, f)), pad(scales[1], (0, f)), pad(scales[2], (0, h)))
        if biases is not None:
            biases = Biases(
                pad(biases.gate, (0, f)), pad(biases.up, (0, f)), pad(biases.down, (0, h))
            )
        out = pallas_products(
            x,
            weights,
            ids,
            gate,
            up,
            down,
            glu=glu,
            biases=biases,
            scales=None if scales[0] is None else scales,
            kernel=platform,
        )
        return out[:, :H]
    bm = _block_m(T * K, X, linear.least_tile_rows(kernel, x.dtype))
    tiles = linear.expert_tiles(ids.reshape(-1), X, bm)
    M = tiles.tile_expert.shape[0] * bm
    rows = jnp.zeros((M, H), x.dtype).at[tiles.rows].set(jnp.repeat(x, K, axis=0), mode="drop")

    def product(a, w, s):
        kw = dict(block_m=bm, kernel=kernel, interpret=interpret)
        return linear.tiled_expert_matmul(a, w, tiles.tile_expert, tiles.tiles_used, s, **kw)

    g, u = product(rows, gate, scales[0]), product(rows, up, scales[1])
    b = None
    if biases is not None:  # each padded row's expert's biases
        b = Biases(*(v.astype(x.dtype) for v in biases)).of(jnp.repeat(tiles.tile_expert, bm))
        g, u = g + b.gate, u + b.up
    y = product(glu(g, u).astype(x.dtype), down, scales[2])
    y = y if b is None else y + b.down
    picked = jnp.take(y, tiles.rows, axis=0, mode="fill", fill_value=0).reshape(T, K, H)
    hi = jax.lax.Precision.HIGHEST
    out = jnp.einsum("tkh,tk->th", picked.astype(jnp.float32), weights, precision=hi)
    return out.astype(x.dtype)


def expert_parallel_products(
    x: jax.Array,  # [T, H]
    weights: jax.Array,  # f32[T, K]
    ids: jax.Array,  # i32[T, K]
    gate: jax.Array,  # [X, H, F], split by expert over the mesh's "tp" axis
    up: jax.Array,  # [X, H, F], so
    down: jax.Array,  # [X, F, H], so
    *,
    way: str,
    glu: Glu = SWIGLU,
    biases: Biases | None = None,
) -> jax.Array:  # [T, H], x.dtype
    """``expert_products``' sum with the experts split by expert over the mesh set with
    ``jax.set_mesh`` (its ``"tp"`` axis; the tokens split along a ``"dp"`` axis where it
    has one): each device weighs 0 the (token, expert) pairs whose expert it does not
    hold, computes its experts' share of every token's sum ``way``, and one all-reduce
    adds the shares (the tokens were on every device already: an all-gather dispatch)."""
    from jax.sharding import PartitionSpec as P

    from paged_jax.sharding import DATA_AXIS, TENSOR_AXIS

    mesh = jax.sharding.get_abstract_mesh()
    rows = P(DATA_AXIS if DATA_AXIS in mesh.axis_names else None)
    experts = P(TENSOR_AXIS)

    def local(x, weights, ids, gate, up, down, biases):
        held = gate.shape[0]
        first = jax.lax.axis_index(TENSOR_AXIS) * held
        mine = (ids >= first) & (ids < first + held)
        # ragged, pallas: another device's pairs to no group (rows past the groups: 0,
        # nothing computed); the other ways multiply every pair, weighed 0 on expert 0
        elsewhere = held if way in ("ragged", "pallas") else 0
        part = expert_products(
            x,
            jnp.where(mine, weights, 0.0),
            jnp.where(mine, ids - first, elsewhere),
            gate,
            up,
            down,
            way=way,
            glu=glu,
            biases=biases,
        )
        return jax.lax.psum(part, TENSOR_AXIS)

    bias_specs = None if biases is None else Biases(experts, experts, experts)
    return jax.shard_map(
        local,
        in_specs=(rows, rows, rows, experts, experts, experts, bias_specs),
        out_specs=rows,
        check_vma=False,
    )(x, weights, ids, gate, up, down, biases)


def packed_products(
    x: jax.Array,  # [T, H]
    weights: jax.Array,  # f32[T, K]
    ids: jax.Array,  # i32[T, K]
    gate_up: jax.Array,  # [(L,) X, P, H, NR] packed (Experts.hold_packed)
    down: jax.Array,  # [(L,) X, P, F, NR] packed
    *,
    width: int,
    glu: Glu = SWIGLU,
    biases: Biases | None = None,
    scales: tuple = ((None, None), (None, None)),
    kept: tuple = ((None, None), (0, 0), False),
) -> jax.Array:  # [T, H], x.dtype
    """``expert_products``' sum with the experts packed for the CPU (quantized ones with
    their packed scales and minimums, ``Experts.packed_scales``): the (token, expert)
    pairs sorted by expert, each expert's rows multiplied by its own weights only
    (``paged_jax.linear.expert_matmul``; the experts of a layer stack from ``LAYER``'s
    layer on), in f32. A step's padding tokens (``ROWS``) choose no expert: no product
    is computed for them."""
    T, H = x.shape
    K = ids.shape[1]
    (s_up, s_down), (m_up, m_down) = scales
    (h_up, h_down), (o_up, o_down), float_rows = kept
    if gate_up.ndim == 5:  # a layer stack: this layer's experts, read where they lie
        X = gate_up.shape[1]
        first = LAYER.get() * X
        whole = lambda a: None if a is None else a.reshape(-1, *a.shape[2:])  # noqa: E731
        gate_up, down, s_up, s_down, m_up, m_down, h_up, h_down = map(
            whole, (gate_up, down, s_up, s_down, m_up, m_down, h_up, h_down)
        )
    else:
        X, first = gate_up.shape[0], 0
    step = ROWS.get()
    if step is not None and step[0] == T:  # padding rows after the real ones: expert X
        ids = jnp.where(jnp.arange(T)[:, None] < step[1], ids, X)
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # by expert; padding last
    sizes = jnp.bincount(flat, length=X).astype(jnp.int32)
    rows = x.astype(jnp.float32)[order // K]

    def extra(high, offset):  # a GGUF file's kept experts: only what they need, named
        kw = {} if high is None else {"high": high}
        kw |= {"offset": offset} if offset else {}
        return kw | ({"float_rows": True} if float_rows else {})

    both = linear.expert_matmul(
        rows, gate_up, 2 * width, sizes, first, s_up, m_up, **extra(h_up, o_up)
    )
    g, u = both[:, :width], both[:, width:]
    b = None if biases is None else biases.of(flat[order])
    if b is not None:
        g, u = g + b.gate.astype(jnp.float32), u + b.up.astype(jnp.float32)
    y = linear.expert_matmul(
        glu(g, u), down, H, sizes, first, s_down, m_down, **extra(h_down, o_down)
    )
    y = y if b is None else y + b.down.astype(jnp.float32)
    back = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    picked = y[back].reshape(T, K, H)
    out = jnp.einsum("tkh,tk->th", picked, weights, precision=jax.lax.Precision.HIGHEST)
    return out.astype(x.dtype)


class Router(nnx.Module):
    """The router's weight ``kernel [H, X]`` (``[L, H, X]`` in a layer stack) and, with
    ``bias``, its ``bias [X]`` (GPT-OSS), held in float and computed in f32 whatever the
    model's weights are quantized to."""

    def __init__(
        self, hidden: int, experts: int, *, rngs: nnx.Rngs, param_dtype, bias: bool = False
    ):
        init = nnx.initializers.lecun_normal()
        self.kernel = nnx.Param(init(rngs.params(), (hidden, experts), param_dtype))
        self.bias = nnx.Param(jnp.zeros((experts,), param_dtype)) if bias else None

    def weight(self) -> jax.Array:  # [(L,) H, X]
        """The kernel as it is held (``Linear.weight``'s counterpart, for writers)."""
        return self.kernel[...]

    def __call__(self, x: jax.Array) -> jax.Array:  # [T, H] -> f32[T, X]
        w = layer_value(self.kernel).astype(jnp.float32)
        logits = jnp.dot(x.astype(jnp.float32), w, precision=jax.lax.Precision.HIGHEST)
        if self.bias is None:
            return logits
        return logits + layer_value(self.bias).astype(jnp.float32)[None]


class Experts(nnx.Module):
    """``X`` gated feed-forward experts of width ``F``: ``gate_proj``, ``up_proj`` ``[X, H,
    F]`` and ``down_proj`` ``[X, F, H]`` (``[L, X, ...]`` in a layer stack), ``[in, out]``
    per expert as ``Linear`` holds its kernels; or, packed for the CPU's C kernel
    (``hold_packed``), ``gate_up`` ``[(L,) X, P, H, NR]`` (gate's columns, then up's) and
    ``down`` ``[(L,) X, P, F, NR]``, multiplied by ``products``' "packed" way. With
    ``bias`` (GPT-OSS), ``gate_bias``, ``up_bias`` ``[(L,) X, F]`` and ``down_bias``
    ``[(L,) X, H]``, kept as they are when packed. ``quantize("int8")``: the three
    weights int8 with f32 scales ``gate_scale``, ``up_scale``, ``down_scale`` (per group
    of 32 inputs for the CPU, ``[(L,) X, in / 32, out]``, or per column elsewhere,
    ``[(L,) X, out]``; ``models.quantization.int8_group``), packed with their scales
    (``gate_up_scales``, ``down_scales``) for the CPU's grouped int8 product.
    ``quantize("int4")``: 4-bit groups of 32 inputs (``quantize_int4``: uint8 ``[(L,) X,
    in / 2, out]``, scales and minimums ``gate_zero``... ``[(L,) X, in / 32, out]``),
    packed with them (``gate_up_zeros``, ``down_zeros`` beside the scales)."""

    packed = False  # hold_packed sets it on the instance (a static attribute)
    quantized = None  # quantize sets it: "int8" or "int4"
    # A GGUF file's experts kept as stored (build_model; models.gguf_blocks.Nibbles):
    # "int4" with float16 scales (f32 where float16 cannot hold them), gate's and up's
    # in one layout and down's in its own, each with its high bits (``gate_high``...
    # ``[(L,) X, in * bits / 8, out]``, ``{part}_bits`` 1 or 2) and minimums or an offset
    # (no ``{n}_zero``: the weights scale * (q - offset)); float_rows: packed products
    # multiply the rows as they are by each dequantized panel (Linear.float_rows)
    float_rows = False
    gate_up_bits = gate_up_offset = down_bits = down_offset = 0
    # models.sharding.shard_model(expert_parallel=True) sets it: the experts split by
    # expert over the mesh's "tp" axis (SparseMoE computes each device's share)
    expert_parallel = False

    def __init__(
        self,
        hidden: int,
        width: int,
        experts: int,
        *,
        rngs: nnx.Rngs,
        param_dtype,
        bias: bool = False,
    ):
        init = nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
        self.gate_proj = nnx.Param(init(rngs.params(), (experts, hidden, width), param_dtype))
        self.up_proj = nnx.Param(init(rngs.params(), (experts, hidden, width), param_dtype))
        self.down_proj = nnx.Param(init(rngs.params(), (experts, width, hidden), param_dtype))
        self.hidden, self.width, self.experts = hidden, width, experts
        if bias:
            zeros = lambda *shape: nnx.Param(jnp.zeros(shape, param_dtype))  # noqa: E731
            self.gate_bias = zeros(experts, width)
            self.up_bias = zeros(experts, width)
            self.down_bias = zeros(experts, hidden)

    def biases(self) -> Biases | None:
        """The experts' biases as they are held, or None (no biases)."""
        if not hasattr(self, "gate_bias"):
            return None
        return Biases(*map(layer_value, (self.gate_bias, self.up_bias, self.down_bias)))

    def weights(self, dtype=None) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``(gate_proj, up_proj, down_proj)`` of the layer being computed, unpacked;
        quantized ones dequantized to ``dtype`` (default f32) inside the step."""
        names = ("gate", "up", "down")
        ws = tuple(layer_value(getattr(self, f"{n}_proj")) for n in names)
        if not self.quantized:
            return ws
        dtype = dtype or jnp.float32
        scales = [layer_value(getattr(self, f"{n}_scale")) for n in names]
        if self.quantized == "int4":
            out = []
            for n, q, s in zip(names, ws, scales, strict=True):
                z, h = (getattr(self, f"{n}_{kind}", None) for kind in ("zero", "high"))
                z, h = (None if v is None else layer_value(v) for v in (z, h))
                offset = self.down_offset if n == "down" else self.gate_up_offset
                out.append(dequantize_int4(q, s, z, -2, dtype, h, offset))
            return tuple(out)
        return tuple(_dequantize(q, s, dtype) for q, s in zip(ws, scales, strict=True))

    def quantize(self, fmt: str = "int8") -> Experts:
        """In place: the experts' float weights in int8 or int4 (the class docstring);
        returns the module. Idempotent. Raises ``ValueError`` for another format, and
        once packed or split per layer."""
        if fmt not in ("int8", "int4"):
            raise ValueError(
                f"quantization: {fmt!r} for a mixture's experts is not supported yet (int8 "
                "and int4 are)"
            )
        if self.quantized:
            return self
        if self.packed or isinstance(self.gate_proj.get_value(), tuple):
            raise ValueError("experts: quantize before packing or splitting the weights")
        for name in ("gate", "up", "down"):
            var = getattr(self, f"{name}_proj")
            w = var.get_value()
            if fmt == "int4":
                q, scale, zero = quantize_int4(w, -2)
                setattr(self, f"{name}_zero", nnx.Param(jnp.asarray(zero)))
            else:
                q, scale = quantize_int8(w, -2, int8_group(w, -2))
            var.set_value(jnp.asarray(q))
            setattr(self, f"{name}_scale", nnx.Param(jnp.asarray(scale)))
        self.quantized = fmt
        return self

    def hold_packed(self) -> Experts:
        """In place: the experts' f32 or bf16 weights packed for the CPU's grouped product
        (``paged_jax.linear.expert_matmul``): gate and up side by side in ``gate_up``, and
        ``down``, each a ``Packed`` read whole by the layer being computed. Returns the
        module. Idempotent. Raises ``ValueError`` for other dtypes."""
        if self.packed:
            return self
        gate, up, down = (w.get_value() for w in (self.gate_proj, self.up_proj, self.down_proj))
        if gate.dtype not in (jnp.float32, jnp.bfloat16, jnp.int8, jnp.uint8):
            raise ValueError(
                f"experts: expected float32, bfloat16, int8 or 4-bit weights, got {gate.dtype}"
            )
        lead = gate.shape[:-2]  # (L, X) or (X,)

        def pack_pair(a, b):  # gate's and up's side by side, packed: [(L,) X, P, rows, NR]
            both = jnp.concatenate([a, b], axis=-1) if b is not None else a
            packed = linear.pack(both.reshape(-1, *both.shape[-2:]))
            return Packed(packed.reshape(*lead, *packed.shape[1:]))

        if self.quantized:  # their scales (and minimums) packed alike, per group of inputs
            kinds = ("scale", "zero") if self.quantized == "int4" else ("scale",)
            for kind in kinds:
                if getattr(self, f"gate_{kind}", None) is None:  # (a kept offset: no mins)
                    continue
                a, b, c = (getattr(self, f"{n}_{kind}").get_value() for n in ("gate", "up", "down"))
                if a.ndim != gate.ndim:
                    raise ValueError(
                        "experts: their int8 scales are per column (quantized for an "
                        "accelerator); quantize them where the CPU computes to pack them"
                    )
                setattr(self, f"gate_up_{kind}s", pack_pair(a, b))
                setattr(self, f"down_{kind}s", pack_pair(c, None))
                for n in ("gate", "up", "down"):
                    delattr(self, f"{n}_{kind}")
            for part, bits in (("gate_up", self.gate_up_bits), ("down", self.down_bits)):
                if not bits:  # the high bits of a GGUF file's 5- and 6-bit experts kept
                    continue
                names = ("gate", "up") if part == "gate_up" else ("down",)
                both = jnp.concatenate([getattr(self, f"{n}_high").get_value() for n in names], -1)
                planes = linear.pack_high(both.reshape(-1, *both.shape[-2:]), bits)
                setattr(self, f"{part}_highs", Packed(planes.reshape(*lead, *planes.shape[1:])))
                for n in names:
                    delattr(self, f"{n}_high")
        rows = gate.shape[-2]  # H (H / 2 for 4-bit weights)
        gate_up = linear.pack(
            jnp.concatenate([gate, up], axis=-1).reshape(-1, rows, 2 * self.width)
        )
        packed_down = linear.pack(down.reshape(-1, down.shape[-2], self.hidden))
        del self.gate_proj, self.up_proj, self.down_proj
        self.gate_up = Packed(gate_up.reshape(*lead, *gate_up.shape[1:]))
        self.down = Packed(packed_down.reshape(*lead, *packed_down.shape[1:]))
        self.packed = True
        return self

    def packable(self) -> bool:
        """Whether ``hold_packed`` takes these experts: float ones, or int8 ones with
        scales per group of inputs (per column, as quantized for an accelerator or for
        widths no group of 32 divides, they stay as they are: the XLA ways dequantize
        them in the step)."""
        if self.packed or not self.quantized:
            return True
        return self.gate_scale.get_value().ndim == self.gate_proj.get_value().ndim

    def column_int8(self) -> bool:
        """Whether the experts are int8 with a scale per output column (as quantized for an
        accelerator): the "pallas" way reads them as they are."""
        if self.packed or self.quantized != "int8":
            return False
        return self.gate_scale.get_value().ndim < self.gate_proj.get_value().ndim

    def packed_scales(self) -> tuple:
        """``((gate_up_scales, down_scales), (gate_up_zeros, down_zeros))`` as packed (the
        scales of int8 and 4-bit experts, the minimums of 4-bit ones; None where none)."""
        if not self.quantized:
            return (None, None), (None, None)
        scales = (self.gate_up_scales[...], self.down_scales[...])
        if self.quantized != "int4":
            return scales, (None, None)
        zeros = tuple(
            None if (z := getattr(self, f"{part}_zeros", None)) is None else z[...]
            for part in ("gate_up", "down")
        )
        return scales, zeros

    def packed_kept(self) -> tuple:
        """``((gate_up_highs, down_highs), (gate_up_offset, down_offset), float_rows)`` of
        a GGUF file's experts kept, as packed (None where a part has no high bits)."""
        highs = tuple(
            None if (h := getattr(self, f"{part}_highs", None)) is None else h[...]
            for part in ("gate_up", "down")
        )
        return highs, (self.gate_up_offset, self.down_offset), self.float_rows


class SparseMoE(nnx.Module):
    """A sparse mixture-of-experts block, ``x [T, H]`` to ``[T, H]``.

    ``gate`` (``Router``) scores the experts, ``route`` picks each token's ``k``
    (``scoring``), ``experts`` (``Experts``) are multiplied ``current_way()``; with
    ``shared_width`` > 0 a shared expert (``MLP`` of that width, not a LoRA target) adds
    ``sigmoid(shared_expert_gate(x)) * shared_expert(x)`` (Qwen2-MoE). ``bias``: the
    router and the experts have biases; ``clamp``: ``(limit, alpha)`` of GPT-OSS's
    clamped unit (``Glu``), or None."""

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
        scoring: str = "softmax",
        bias: bool = False,
        clamp: tuple[float, float] | None = None,
        rngs: nnx.Rngs,
        dtype,
        param_dtype,
    ):
        kw = dict(rngs=rngs, param_dtype=param_dtype, bias=bias)
        self.gate = Router(hidden, experts, **kw)
        self.experts = Experts(hidden, width, experts, **kw)
        self.k, self.normalize, self.scoring = k, normalize, scoring
        limit, alpha = clamp or (None, 1.702)
        self.glu = Glu(gelu=act == "gelu_tanh", limit=limit, alpha=alpha)
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
        return route(self.gate(x), self.k, normalize=self.normalize, scoring=self.scoring)

    def __call__(self, x: jax.Array) -> jax.Array:
        weights, ids = self.choices(x)
        e = self.experts
        x = x if self.dtype is None else x.astype(self.dtype)
        if e.packed:
            out = packed_products(
                x,
                weights,
                ids,
                e.gate_up[...],
                e.down[...],
                width=e.width,
                glu=self.glu,
                biases=e.biases(),
                scales=e.packed_scales(),
                kept=e.packed_kept(),
            )
        else:
            way = "dense" if (way := current_way()) == "packed" else way
            if way == "pallas" and not e.expert_parallel and _split_by_mesh():
                way = "ragged"  # a Pallas call is not partitioned: XLA's grouped product
            products = expert_parallel_products if e.expert_parallel else expert_products
            if way == "pallas" and e.column_int8() and not e.expert_parallel:
                names = ("gate", "up", "down")  # read as int8, their scales on the sums
                out = pallas_products(
                    x,
                    weights,
                    ids,
                    *(layer_value(getattr(e, f"{n}_proj")) for n in names),
                    glu=self.glu,
                    biases=e.biases(),
                    scales=tuple(layer_value(getattr(e, f"{n}_scale")) for n in names),
                )
            else:
                out = products(
                    x,
                    weights,
                    ids,
                    *e.weights(x.dtype),
                    way=way,
                    glu=self.glu,
                    biases=e.biases(),
                )
        if self.shared_expert is not None:
            scale = jax.nn.sigmoid(self.shared_expert_gate(x).astype(jnp.float32))
            out = out + (scale * self.shared_expert(x).astype(jnp.float32)).astype(out.dtype)
        return out

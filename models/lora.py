"""LoRA adapters over a loaded model: PEFT's files read into arrays, the device slots
that hold several adapters at once, and the product that applies each token's own.

An adapter (``load_adapter``) is PEFT's ``adapter_config.json`` and
``adapter_model.safetensors``: for each target projection (q/k/v/o, gate/up/down) of each
layer, ``lora_A`` ``[r, in]`` and ``lora_B`` ``[out, r]``; the projection computes
``x @ W + scale * (x @ A.T) @ B.T`` with ``scale = alpha / r`` (``alpha / sqrt(r)`` with
rsLoRA). Here it is held as ``A [L, in, r]`` and ``B [L, r, out]`` with the scale folded
into B, zeros for layers the adapter leaves out (``layers_to_transform``).

On the device (``LoraBank``, ``LlamaForCausalLM.enable_lora``) ``S`` slots of rank up to
``R`` are stacked side by side for every target: ``a [L, in, S R]``, ``b [L, S R, out]``,
slot s in columns (rows of b) ``[s R, (s + 1) R)``, zero-padded past an adapter's rank.
A step gives each token an index (``adapter_ids``: 0 none, s + 1 slot s); a projection
then adds ``((x @ a[l]) * mask) @ b[l]``, the mask keeping each token's own slot's
columns: two dense products of inner size ``S R`` for the whole batch, no sort, no
gather of weights per token, the same program whichever rows use which adapter. It costs
``2 S R (in + out)`` FLOPs a token a target: with S R = 64 and 4096-wide projections
about 3% of the projection's own. Steps where no row has an adapter skip it (the engine
passes no ``adapter_ids``).

Off the CPU the projections of one input are fused (q/k/v, gate/up:
``LlamaForCausalLM.hold_for_accelerator``) and the bank follows (``LoraBank.regroup``):
a fused projection's targets' A side by side and their B block-diagonal, so it adds its
adapters with two products, not two a target (8 products a layer instead of 14): on a
GPU each product costs a launch beyond its bytes (docs/DECISIONS.md, "LoRA banks off the
CPU"). The bank is held per layer there too (``LoraBank.split_layers``), as the model's
own weights are: XLA copied each layer's static slice of a stacked array out before its
product, 8 copies a layer and step (not yet measured on a GPU). The adapters' products
take their projection's precision (``delta``'s ``precision``), so XLA:GPU computes
``x @ A`` in the projection's own GEMM, and an accelerator's bank pads A for JAX 0.11.2's
pickier merger (``LoraBank.pad_for_merge``; the kernel counts in docs/DECISIONS.md). On the
CPU (f32 banks, the C kernels built) each row is multiplied by its own slot's A and B
only (``paged_jax.linear.lora_delta``; ``CPU_KERNEL``).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import pathlib
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .compressed import read_json_object, read_safetensors
from .config import LlamaConfig

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


ATTENTION_TARGETS = TARGETS[:4]


def targets_of(cfg: LlamaConfig) -> tuple[str, ...]:
    """The projections of ``cfg``'s layers an adapter may reach: all of ``TARGETS``, or
    for a mixture of experts the attention's (its feed-forward blocks are experts)."""
    return ATTENTION_TARGETS if cfg.sparse else TARGETS


def target_shape(cfg: LlamaConfig, target: str) -> tuple[int, int]:
    """``(in, out)`` of projection ``target`` of ``cfg``'s layers."""
    E, F = cfg.hidden_size, cfg.intermediate_size
    HD, KD = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {
        "q_proj": (E, HD),
        "k_proj": (E, KD),
        "v_proj": (E, KD),
        "o_proj": (HD, E),
        "gate_proj": (E, F),
        "up_proj": (E, F),
        "down_proj": (F, E),
    }[target]


@dataclasses.dataclass
class LoraAdapter:
    """A LoRA adapter as arrays: ``weights[target] = (A f32[L, in, r], B f32[L, r, out])``
    with ``scale`` folded into B. ``rank``: r; ``scale``: what B was multiplied by."""

    name: str
    rank: int
    scale: float
    weights: dict[str, tuple[np.ndarray, np.ndarray]]


_NAME = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_(A|B)(?:\.[\w-]+)?\.weight$")


def load_adapter(path: str | pathlib.Path, cfg: LlamaConfig, name: str | None = None):
    """The PEFT LoRA adapter in directory ``path`` for a model of ``cfg``, as a
    ``LoraAdapter``. Raises FileNotFoundError for missing files and ValueError naming the
    field or tensor for what does not fit: another PEFT type, DoRA, biases,
    ``fan_in_fan_out``, ``modules_to_save``, per-module ranks, a target that is not one
    of ``targets_of(cfg)`` (a mixture's feed-forward targets named so), a layer or a shape
    the model does not have."""
    root = pathlib.Path(path)
    cfg_file, weights_file = root / "adapter_config.json", root / "adapter_model.safetensors"
    for f in (cfg_file, weights_file):
        if not f.exists():
            raise FileNotFoundError(f"{f}: missing (a PEFT adapter directory holds both files)")
    raw = read_json_object(cfg_file)

    def refuse(field, what):
        raise ValueError(f"{cfg_file}: {field}: {what}")

    if raw.get("peft_type", "LORA") != "LORA":
        refuse("peft_type", f"expected 'LORA', got {raw.get('peft_type')!r}")
    r, alpha = raw.get("r"), raw.get("lora_alpha")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        refuse("r", f"expected an int >= 1, got {r!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not alpha > 0:
        refuse("lora_alpha", f"expected a number > 0, got {alpha!r}")
    for field, ok in (
        ("use_dora", not raw.get("use_dora")),
        ("bias", raw.get("bias", "none") == "none"),
        ("fan_in_fan_out", not raw.get("fan_in_fan_out")),
        ("modules_to_save", not raw.get("modules_to_save")),
        ("rank_pattern", not raw.get("rank_pattern")),
        ("alpha_pattern", not raw.get("alpha_pattern")),
        ("layer_replication", not raw.get("layer_replication")),
    ):
        if not ok:
            refuse(field, f"{raw.get(field)!r} is not supported")
    scale = alpha / math.sqrt(r) if raw.get("use_rslora") else alpha / r
    tensors = read_safetensors(weights_file)
    L = cfg.num_layers
    parts: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    for tname, value in tensors.items():
        m = _NAME.search(tname)
        if m is None:
            raise ValueError(f"{weights_file}: tensor {tname!r} is not a LoRA A or B weight")
        layer, target, ab = int(m.group(1)), m.group(2), m.group(3)
        if target not in targets_of(cfg):
            why = (
                ": a mixture of experts' feed-forward blocks take no adapters; its targets are "
                if target in TARGETS
                else " is not one of "
            )
            raise ValueError(
                f"{weights_file}: tensor {tname!r}: target {target!r}{why}"
                f"{', '.join(targets_of(cfg))}"
            )
        if layer >= L:
            raise ValueError(f"{weights_file}: tensor {tname!r}: the model has {L} layers")
        fan_in, fan_out = target_shape(cfg, target)
        want = (r, fan_in) if ab == "A" else (fan_out, r)
        if tuple(value.shape) != want:
            raise ValueError(
                f"{weights_file}: tensor {tname!r} has shape {list(value.shape)}, expected "
                f"{list(want)} for the model's {target}"
            )
        parts.setdefault((target, ab), {})[layer] = np.asarray(value, np.float32)
    weights = {}
    for target in targets_of(cfg):
        a_of, b_of = parts.get((target, "A"), {}), parts.get((target, "B"), {})
        if set(a_of) != set(b_of):
            only = sorted(set(a_of) ^ set(b_of))
            raise ValueError(f"{weights_file}: {target}: layers {only} have A or B, not both")
        if not a_of:
            continue
        fan_in, fan_out = target_shape(cfg, target)
        A = np.zeros((L, fan_in, r), np.float32)
        B = np.zeros((L, r, fan_out), np.float32)
        for i in a_of:
            A[i] = a_of[i].T
            B[i] = b_of[i].T * scale
        weights[target] = (A, B)
    if not weights:
        raise ValueError(f"{weights_file}: no LoRA weights")
    return LoraAdapter(name or root.name, r, float(scale), weights)


class LoraWeight(nnx.Variable):
    """A LoRA slot bank's array (``LoraBank``): not a model weight (``nnx.Param``)."""


# One pair of bank arrays a target: the layout a bank is made in (``LoraBank.groups``).
PER_TARGET = tuple((t, (t,)) for t in TARGETS)
# ``LoraBank.pad_for_merge``: A's columns at least this fraction of the projection's
# outputs, where that takes at most MERGE_MAX_PAD times the columns A has.
MERGE_FRACTION = 1 / 16
MERGE_MAX_PAD = 4


class LoraBank(nnx.Module):
    """``slots`` adapters of rank up to ``rank`` for every target of ``cfg``'s layers, in
    ``LoraWeight`` arrays, zeros until ``slot_arrays`` fills a slot. As made, one pair a
    target: ``a_<target>`` ``[L, in, slots * rank]`` and ``b_<target>`` ``[L, slots *
    rank, out]``. ``regroup`` lays targets that one fused projection computes
    (``LlamaForCausalLM.hold_for_accelerator``: q/k/v, gate/up) out as one pair, so that
    projection adds its adapters with two products instead of two a target:
    ``a_<group>`` ``[L, in, n S R]`` (each target's slots side by side, in order) and a
    block-diagonal ``b_<group>`` ``[L, n S R, out_1 + ... + out_n]`` (target j's rows
    ``[j S R, (j + 1) S R)`` feed its own outputs only; zeros elsewhere). ``groups``:
    ``((name, targets), ...)``, the pairs held; ``widths``: ``((target, (in, out)),
    ...)``. ``split_layers`` holds each array as a tuple of its L layers' (``per_layer``),
    as an accelerator holds the model's own weights."""

    per_layer = False  # split_layers sets it on the instance (a static attribute)

    def __init__(self, cfg: LlamaConfig, slots: int, rank: int, dtype):
        self.slots, self.rank = slots, rank
        self.targets = targets_of(cfg)
        self.groups = tuple((t, (t,)) for t in self.targets)
        self.widths = tuple((t, target_shape(cfg, t)) for t in self.targets)  # (in, out)
        L, width = cfg.num_layers, slots * rank
        for t in self.targets:
            fan_in, fan_out = target_shape(cfg, t)
            setattr(self, f"a_{t}", LoraWeight(jnp.zeros((L, fan_in, width), dtype)))
            setattr(self, f"b_{t}", LoraWeight(jnp.zeros((L, width, fan_out), dtype)))

    def group_of(self, targets: tuple[str, ...]) -> str | None:
        """The name of the pair holding exactly ``targets``, or None."""
        return next((name for name, ts in self.groups if ts == tuple(targets)), None)

    def regroup(self, groups) -> LoraBank:
        """In place: the pairs laid out as ``groups`` (``((name, targets), ...)``, each
        target in one), built from one pair a target with what the slots hold; returns
        the bank. Idempotent. Raises ``ValueError`` from another layout."""
        groups = tuple((name, tuple(ts)) for name, ts in groups)
        if groups == self.groups:
            return self
        if self.per_layer:
            raise ValueError("groups: the bank is split by layer already; regroup before")
        if any(len(ts) != 1 for _, ts in self.groups):
            raise ValueError("groups: the bank is grouped already; regroup from one a target")
        if sorted(t for _, ts in groups for t in ts) != sorted(self.targets):
            raise ValueError(
                f"groups: expected each of {', '.join(self.targets)} once, got {groups}"
            )
        for name, ts in groups:
            if len(ts) == 1:
                continue
            a = [getattr(self, f"a_{t}")[...] for t in ts]
            b = [getattr(self, f"b_{t}")[...] for t in ts]
            width, outs = b[0].shape[1], [x.shape[2] for x in b]
            block = jnp.zeros((b[0].shape[0], len(ts) * width, sum(outs)), b[0].dtype)
            for j, x in enumerate(b):
                rows, cols = (
                    slice(j * width, (j + 1) * width),
                    slice(sum(outs[:j]), sum(outs[: j + 1])),
                )
                block = block.at[:, rows, cols].set(x)
            for t in ts:
                delattr(self, f"a_{t}")
                delattr(self, f"b_{t}")
            setattr(self, f"a_{name}", LoraWeight(jnp.concatenate(a, axis=2)))
            setattr(self, f"b_{name}", LoraWeight(block))
        self.groups = groups
        return self

    def pad_for_merge(self) -> LoraBank:
        """In place: each pair's A widened with zero columns to ``MERGE_FRACTION`` of its
        projection's outputs where that costs at most ``MERGE_MAX_PAD`` times its own
        columns; returns the bank. ``delta`` uses the first ``n S R`` columns only. Why:
        XLA:GPU's dot merger (JAX 0.11.2) computes ``x @ A`` inside the projection's own
        GEMM only where the smaller product is at least a sixteenth of the larger, and 8
        slots of rank 16 give o's and down's A 128 columns against 4096 outputs (a GEMM and
        a reduction more a layer each; ``python -m benchmarks step_kernels``). Before
        ``split_layers`` (a bank split already is left as it is, padded then or not)."""
        if self.per_layer:
            return self
        outs = dict(self.widths)
        for name, ts in self.groups:
            var = getattr(self, f"a_{name}")
            a = var.get_value()
            real = len(ts) * self.slots * self.rank
            want = -(-sum(outs[t][1] for t in ts) // int(round(1 / MERGE_FRACTION)))
            if a.shape[-1] != real or want <= real or want > MERGE_MAX_PAD * real:
                continue
            var.set_value(jnp.pad(a, ((0, 0), (0, 0), (0, want - real))))
        return self

    def split_layers(self) -> LoraBank:
        """In place: each array ``[L, ...]`` becomes a tuple of its L layers' arrays, so a
        layer's products read its own where it lies (``LlamaForCausalLM.
        hold_for_accelerator``, whose layers run unrolled; there a static slice of a
        stack is copied before its product, as the model's own stacked weights were on
        an H100). Returns the bank. Idempotent; after ``regroup``."""
        if self.per_layer:
            return self
        for name in self.arrays():
            var = getattr(self, name)
            w = var.get_value()
            var.set_value(tuple(w[i] for i in range(w.shape[0])))
        self.per_layer = True
        return self

    def join_layers(self) -> LoraBank:
        """In place: ``split_layers`` undone, each array one ``[L, ...]`` stack again (for
        scanned layers: ``LlamaForCausalLM.hold_for_cpu``). Returns the bank."""
        if not self.per_layer:
            return self
        for name in self.arrays():
            var = getattr(self, name)
            var.set_value(jnp.stack(var.get_value()))
        self.per_layer = False
        return self

    def arrays(self) -> list[str]:
        """The names of the bank's arrays (``a_<group>``, ``b_<group>``), in order."""
        return [f"{side}_{name}" for name, _ in self.groups for side in ("a", "b")]


def slot_arrays(
    adapter: LoraAdapter | None,
    slots: int,
    rank: int,
    slot: int,
    arrays: dict,
    groups=None,
    widths=None,
):
    """``arrays`` (a ``LoraBank``'s, by variable name: ``a_<group>``, ``b_<group>``) with
    slot ``slot`` holding ``adapter`` (None: zeros), as new arrays (jnp; one update a
    target and side). ``groups`` and ``widths``: the bank's (``LoraBank.groups``, default
    one pair a target; ``LoraBank.widths``, each target's ``(in, out)``, needed for a
    group of several)."""
    if adapter is not None and adapter.rank > rank:
        raise ValueError(f"adapter {adapter.name!r}: rank {adapter.rank} > the slots' {rank}")
    groups = PER_TARGET if groups is None else groups
    widths = {} if widths is None else dict(widths)
    out = {}
    for name, ts in groups:
        a, b = arrays[f"a_{name}"], arrays[f"b_{name}"]
        # a split bank (LoraBank.split_layers): tuples of per-layer [in, S R] / [S R, out]
        layers = len(a) if isinstance(a, tuple) else a.shape[0]
        fan_in, dtype = _first(a).shape[-2], _first(a).dtype
        width = slots * rank
        col = 0
        for j, t in enumerate(ts):
            fan_out = _first(b).shape[-1] if len(ts) == 1 else widths[t][1]
            A = np.zeros((layers, fan_in, rank), np.float32)
            B = np.zeros((layers, rank, fan_out), np.float32)
            if adapter is not None and t in adapter.weights:
                src_a, src_b = adapter.weights[t]
                A[..., : adapter.rank] = src_a
                B[:, : adapter.rank] = src_b
            lo = j * width + slot * rank
            a = _set_block(a, jnp.asarray(A, dtype), jnp.int32(0), jnp.int32(lo))
            b = _set_block(b, jnp.asarray(B, dtype), jnp.int32(lo), jnp.int32(col))
            col += fan_out
        out[f"a_{name}"], out[f"b_{name}"] = a, b
    return out


def _first(w):
    """An array, or the first of a tuple of per-layer arrays."""
    return w[0] if isinstance(w, tuple) else w


@jax.jit
def _set_block(a, v, row, col):
    """``a`` (3-D ``[L, ...]``, or a tuple of its L layers' 2-D arrays) with ``v`` (3-D)
    at ``[:, row:, col:]``: one call either way."""
    if isinstance(a, tuple):
        return tuple(jax.lax.dynamic_update_slice(w, v[i], (row, col)) for i, w in enumerate(a))
    return jax.lax.dynamic_update_slice(a, v, (jnp.int32(0), row, col))


# While a step's layers run with adapters: (the bank, the rows' selector: the mask
# f[T, S R] of ``token_mask``, or on the CPU kernel's way the slot ids i32[T] themselves).
_LORA: contextvars.ContextVar[tuple[Any, jax.Array] | None] = contextvars.ContextVar(
    "paged_jax_lora", default=None
)

# Whether a model on the CPU (kernels built, f32 banks) adds its adapters with the C
# kernel (``paged_jax.linear.lora_delta``: each row its own slot) instead of XLA's
# products over every slot and a mask. Tests switch it off to compare the two.
CPU_KERNEL = True


def by_kernel(bank) -> bool:
    """Whether ``bank``'s adapters go through the CPU kernel (``CPU_KERNEL``, the CPU
    kernels available, f32 banks); the selector is then the rows' ids, not a mask."""
    from paged_jax import linear

    if not CPU_KERNEL or any(len(ts) != 1 for _, ts in bank.groups):
        return False  # (a grouped bank is an accelerator's layout: the masked products)
    if any(_first(getattr(bank, f"a_{t}").get_value()).shape[-1] != bank.slots * bank.rank
           for _, (t,) in bank.groups):  # fmt: skip
        return False  # (padded for an accelerator's dot merger)
    return bank.a_q_proj[...].dtype == jnp.float32 and linear.available()


def token_mask(adapter_ids: jax.Array, slots: int, rank: int, dtype) -> jax.Array:
    """``[T, slots * rank]``: 1 in token t's slot's columns (``adapter_ids[t] - 1``), 0
    elsewhere (all 0 for a token without an adapter, id 0)."""
    col = jnp.arange(slots * rank, dtype=jnp.int32) // rank
    return (col[None, :] == (adapter_ids.astype(jnp.int32) - 1)[:, None]).astype(dtype)


def selector(bank, adapter_ids: jax.Array) -> jax.Array:
    """What ``rows`` takes for rows of ``adapter_ids`` (i32[T], slot plus one): the ids on
    the CPU kernel's way (``by_kernel``), else their ``token_mask`` (f32)."""
    if by_kernel(bank):
        return adapter_ids.astype(jnp.int32)
    return token_mask(adapter_ids, bank.slots, bank.rank, jnp.float32)


@contextlib.contextmanager
def rows(bank, mask):
    """While active, projections of rows ``mask`` (``selector``: a ``token_mask``, or the
    rows' slot ids) add their adapters from ``bank``; a None ``mask`` (no adapters this
    step) leaves them as they are."""
    token = _LORA.set(None if mask is None else (bank, mask))
    try:
        yield
    finally:
        _LORA.reset(token)


def current_mask():
    """The mask of the rows being computed (``rows``), or None."""
    ctx = _LORA.get()
    return None if ctx is None else ctx[1]


def delta(targets: tuple[str, ...], x: jax.Array, layer, precision=None) -> jax.Array | None:
    """What the active adapters add to a projection computing ``targets`` (one, or a
    fused module's parts, side by side) of ``layer`` (an int, or a traced index), for
    rows ``x [T, in]``; None outside ``rows``. ``precision``: the projection's own
    (``jax.lax.Precision``), which the adapters' products take too: an f32 model's are
    then as exact as its weights' (no TF32 on a GPU), and XLA:GPU, seeing ``x @ A`` and
    the projection's ``x @ W`` alike, computes both in one GEMM (its dot merger; with
    another precision they were two kernels a projection)."""
    ctx = _LORA.get()
    if ctx is None or not targets:
        return None
    bank, mask = ctx
    group = bank.group_of(targets) if len(targets) > 1 else None
    if group is not None and not jnp.issubdtype(mask.dtype, jnp.integer):
        # one pair for the fused projection: its targets' A side by side, B block-diagonal
        a = _layer(bank, f"a_{group}", layer)
        b = _layer(bank, f"b_{group}", layer)
        m = jnp.tile(mask.astype(a.dtype), (1, len(targets)))
        h = _dot(x.astype(a.dtype), a, precision)[..., : m.shape[-1]]  # (pad_for_merge)
        return _dot(h * m, b, precision)
    outs = []
    for t in targets:
        if jnp.issubdtype(mask.dtype, jnp.integer):  # the rows' ids: the CPU kernel
            from paged_jax import linear

            a, b = getattr(bank, f"a_{t}")[...], getattr(bank, f"b_{t}")[...]
            lead = x.shape[:-1]
            x2 = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
            d = linear.lora_delta(x2, a, b, mask.reshape(-1), layer, bank.rank)
            outs.append(d.reshape(*lead, d.shape[-1]))
            continue
        a, b = _layer(bank, f"a_{t}", layer), _layer(bank, f"b_{t}", layer)
        h = _dot(x.astype(a.dtype), a, precision)[..., : mask.shape[-1]]  # (pad_for_merge)
        h = h * mask.astype(a.dtype)
        outs.append(_dot(h, b, precision))
    return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=-1)


def _dot(x: jax.Array, w: jax.Array, precision) -> jax.Array:
    """``x [..., in] @ w [in, out]`` at ``precision``, as ``nnx.Linear`` writes its product."""
    return jax.lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())), precision=precision)


def _layer(bank, name: str, layer):
    """Layer ``layer``'s array of the bank's ``name``: a split bank's own (only a model
    whose layers run unrolled splits its bank, so ``layer`` is a Python int), else the
    stack's slice."""
    w = getattr(bank, name).get_value()
    return w[int(layer)] if isinstance(w, tuple) else w[layer]

"""The jitted step's two ends: its host inputs packed into one buffer
(``_pack_inputs``, read back in the step by ``_unpack_inputs``) and the sampling of its
rows (``_row_sampler``), also as a function of its own for steps sampled after their
model call (``_make_sample``, ``DeferredSample``: structured output in overlapped steps).
``runner`` builds the step around them."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from paged_jax import linear as paged_linear
from paged_jax.engine.sampling import beam_candidates, sample_rows
from paged_jax.engine.step_types import SamplingColumns, StepOutputs
from paged_jax.invariant import rowwise
from paged_jax.metadata import AttentionMetadata

# The step's host inputs travel to the device as one flat int32 buffer: as jit
# arguments, each numpy array costs a host-to-device buffer of its own (about 3 us warm on
# CPU, 25 us in the engine's loop), and a step has 16 of them.
_MD_ARRAYS = tuple(
    f.name for f in dataclasses.fields(AttentionMetadata) if not f.metadata.get("static")
)
# The sampling columns' names inside the step, in SamplingColumns' field order
_SAMPLING = ("temp", "top_k", "top_p", "min_p", "seeds", "out_pos")
# In the buffer, in order (then "steps" for a multi-step launch); seeds (uint32) go as
# their bits. Then the float32 arrays, as their bits too: temp, top_p, min_p.
_INTS = ("positions", *_MD_ARRAYS, "top_k", "seeds", "out_pos")
_FLOATS = ("temp", "top_p", "min_p")


def _padded(a: np.ndarray, n: int) -> np.ndarray:
    """``i32[n]``: ``a`` then zeros (``np.pad`` costs several times more)."""
    out = np.zeros(n, np.int32)
    out[: len(a)] = a
    return out


def _pack_inputs(batch, sampling: SamplingColumns, steps) -> tuple[np.ndarray, tuple]:
    """``(inputs i32[N], layout)``: the batch's positions and metadata, the sampling
    columns and ``steps`` (``i32[S_b]`` or None) packed into one buffer (uint32 and
    float32 arrays as their bits), and the layout ``_unpack_inputs`` reads them back with
    (static: the arrays' shapes, which the batch's buckets fix)."""
    temp, top_k, top_p, min_p, seeds, out_pos = sampling.columns()
    ints = [batch.positions, *(getattr(batch, k) for k in _MD_ARRAYS)]
    ints += (top_k, seeds.view(np.int32), out_pos)
    if steps is not None:
        ints.append(steps)
    floats = (temp, top_p, min_p)
    layout = (tuple(a.shape for a in ints), tuple(a.shape for a in floats))
    parts = ints + [np.asarray(a, np.float32).view(np.int32) for a in floats]
    return np.concatenate(parts, axis=None), layout


def _unpack_inputs(inputs: jax.Array, layout: tuple) -> dict[str, jax.Array]:
    """The arrays ``_pack_inputs`` packed, by name (in a jitted function: slices)."""
    out = {}
    at = 0
    for names, shapes in ((_INTS + ("steps",), layout[0]), (_FLOATS, layout[1])):
        for name, shape in zip(names, shapes, strict=False):
            n = int(np.prod(shape))
            out[name] = inputs[at : at + n].reshape(shape)
            at += n
    out["seeds"] = jax.lax.bitcast_convert_type(out["seeds"], jnp.uint32)
    for name in _FLOATS:
        out[name] = jax.lax.bitcast_convert_type(out[name], jnp.float32)
    return out


@dataclasses.dataclass
class DeferredSample:
    """A step launched with ``defer_sample``: what ``ModelRunner.sample`` needs to sample
    its rows (the logits ``f32[S_b, V]`` on the device, the packed inputs and their
    layout, the penalties, the sampler's static flags), and the model call's prompt
    scores (``StepOutputs.scores``, or None)."""

    logits: Any
    inputs: Any
    layout: tuple
    penalties: Any
    batch_invariant: bool
    num_candidates: int
    greedy_only: bool
    scores: Any = None


def _row_sampler(x, penalties, allowed, *, invariant, greedy_only, cpu_kernel, sort_free):
    """``sample(logits, pos) -> (tokens, log-probs)`` of the step's rows: ``sample_rows``
    row by row (``rowwise``) with the rows' sampling columns ``x`` (unpacked inputs),
    ``penalties`` and ``allowed`` masks (or None)."""

    def sample(logits, pos):
        return rowwise(
            lambda *rows: sample_rows(
                *rows, greedy_only=greedy_only, cpu_kernel=cpu_kernel, sort_free=sort_free
            ),
            logits,
            x["temp"],
            x["top_k"],
            x["top_p"],
            x["seeds"],
            pos,
            x["min_p"],
            penalties,
            allowed,
            invariant=invariant,
        )

    return sample


def _replicator(mesh):
    """Constrains an output to be whole on every device of ``mesh`` (identity off one)."""

    def replicated(x):
        if mesh is None:
            return x
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec()))

    return replicated


def _cpu_kernel(mesh) -> bool:
    # The greedy sampler's C kernel: on CPU where the kernels built (as for packed
    # weights), off a mesh (XLA would gather a sharded operand for it).
    return mesh is None and paged_linear.available()


@functools.lru_cache(maxsize=8)
def _make_sample(mesh, sort_free: bool | str = False):
    """The sampling half of a step run in two (``ModelRunner.launch(defer_sample=True)``):
    the rows' tokens, log-probs and beam candidates from the logits ``_make_run`` returned
    with ``logits_only``, for steps whose masks are filled after their model call is
    dispatched (structured output in overlapped steps). ``sort_free`` as ``_make_run``'s."""
    replicated = _replicator(mesh)
    cpu_kernel = _cpu_kernel(mesh)

    @functools.partial(
        jax.jit, static_argnames=("layout", "batch_invariant", "num_candidates", "greedy_only")
    )
    def sample_step(
        logits,
        inputs,
        penalties,
        allowed,
        cand_allowed,
        *,
        layout,
        batch_invariant,
        num_candidates,
        greedy_only,
    ):
        x = _unpack_inputs(inputs, layout)
        sample = _row_sampler(
            x,
            penalties,
            allowed,
            invariant=batch_invariant,
            greedy_only=greedy_only,
            cpu_kernel=cpu_kernel,
            sort_free=sort_free,
        )
        toks, lps = sample(logits, x["out_pos"])
        out = StepOutputs(tokens=toks, logprobs=lps)
        if num_candidates:
            out.cand_logprobs, out.cand_ids = beam_candidates(logits, num_candidates, cand_allowed)
        return out.map(replicated)

    return sample_step

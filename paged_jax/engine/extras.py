"""The extras sampler: with static shapes (after ``LLM.warm_up``), a step whose rows have
extras (penalties, logit biases, ``min_tokens``, token masks of ``allowed_token_ids`` or a
grammar, candidates for ``top_logprobs`` or beams) runs the plain step's program, which
keeps its logits on the device, and its rows are sampled here: one program a row count
whatever the extras (``_make_extras_sample``), each extra's presence data read by a
``lax.cond`` rather than a jit key, so warm-up compiles them all (``ExtrasSampler.warm``).
``ModelRunner`` holds one ``ExtrasSampler``."""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.batch import bucket
from paged_jax.engine.devices import mesh_context
from paged_jax.engine.sampling import (
    _NEUTRAL,
    Penalties,
    apply_penalties,
    beam_candidates,
    mask_logits,
    raw_logprobs,
)
from paged_jax.engine.step_io import _FLOATS, _cpu_kernel, _replicator, _row_sampler
from paged_jax.engine.step_types import Dispatched, SamplingColumns, StepOutputs
from paged_jax.invariant import rowwise

log = logging.getLogger("paged_jax")


# The candidates (most likely tokens and their log-probs) the extras sampler returns for
# every row: ``top_logprobs`` (at most 20) and beams up to 16 wide bucket to at most this.
# Wider beams take a second program per row count, of the engine's widest (``ExtrasSampler.
# widths``).
EXTRAS_CANDIDATES = 32
# The samples each row draws there (the first token of ``n <= 16`` samples; the columns
# past a step's own are dropped): drawing 16 instead of 1 cost 0.3-0.6 ms of a sampler's
# 1-16 ms at 8-64 rows on CPU, a second program per row count more. ``n`` over 16 takes
# the second program (the engine's largest ``n``).
EXTRAS_SAMPLES = 16
# The logit biases a row may carry there (``MAX_LOGIT_BIAS`` and the stop tokens that
# ``min_tokens`` bans); a step with more takes the step's own variant.
EXTRAS_BIASES = 2048


def pack_columns(sampling: SamplingColumns) -> tuple[np.ndarray, tuple]:
    """``(columns i32[N], layout)``: the sampling columns alone packed into one buffer, as
    ``_pack_inputs`` packs them (the layout depends on the rows and samples a row only)."""
    temp, top_k, top_p, min_p, seeds, out_pos = sampling.columns()
    ints = (top_k, seeds.view(np.int32), out_pos)
    floats = (temp, top_p, min_p)
    layout = (tuple(a.shape for a in ints), tuple(a.shape for a in floats))
    parts = list(ints) + [np.asarray(a, np.float32).view(np.int32) for a in floats]
    return np.concatenate(parts, axis=None), layout


def _unpack_columns(columns: jax.Array, layout: tuple) -> dict[str, jax.Array]:
    """The arrays ``pack_columns`` packed, by name (in a jitted function: slices)."""
    out, at = {}, 0
    for names, shapes in ((("top_k", "seeds", "out_pos"), layout[0]), (_FLOATS, layout[1])):
        for name, shape in zip(names, shapes, strict=True):
            n = int(np.prod(shape))
            out[name] = columns[at : at + n].reshape(shape)
            at += n
    out["seeds"] = jax.lax.bitcast_convert_type(out["seeds"], jnp.uint32)
    for name in _FLOATS:
        out[name] = jax.lax.bitcast_convert_type(out[name], jnp.float32)
    return out


@dataclasses.dataclass
class ExtrasSample:
    """A static-shape step whose rows have extras, its model call dispatched: what
    ``ModelRunner.sample`` needs to sample them with ``_make_extras_sample`` (the logits
    ``f32[R_b, V]`` on the device, the rows' columns, penalties as the host built them or
    None, the candidates asked), and the model call's prompt scores."""

    logits: Any
    sampling: SamplingColumns
    penalties: Any
    num_candidates: int
    batch_invariant: bool
    scores: Any = None


@functools.lru_cache(maxsize=8)
def _make_extras_sample(mesh, sort_free: bool | str = False, candidates: int = EXTRAS_CANDIDATES):
    """The sampler of a static-shape step whose rows have extras: one program for every
    mix of them at a row count (``layout``), each extra's presence an entry of ``flags``
    (``i32[3]``: penalties and biases, token masks, candidates) that a ``lax.cond``
    reads, so a step pays only for the extras it has. Penalty histories come padded to
    the engine's ``max_model_len`` (bucketed) and biases to ``EXTRAS_BIASES``; absent
    extras come as neutral arrays (``ModelRunner``'s, kept on the device). The tokens,
    their log-probs under the model's raw distribution and ``candidates`` candidates are
    those ``_make_sample`` gives with the same extras. ``sort_free`` as ``_make_run``'s."""
    replicated = _replicator(mesh)
    cpu_kernel = _cpu_kernel(mesh)

    @functools.partial(jax.jit, static_argnames=("layout", "batch_invariant"))
    def sample_extras(
        logits,  # f32[R, V]
        columns,  # i32[N]: pack_columns' buffer
        penalties,  # Penalties of R rows, fixed widths
        allowed,  # i32[R, ceil(V / 32)]
        cand_allowed,  # i32[R, ceil(V / 32)]
        flags,  # i32[3]
        *,
        layout,
        batch_invariant,
    ):
        x = _unpack_columns(columns, layout)
        raw = logits

        def adjust(raw, penalties, allowed):
            adj = jax.lax.cond(flags[0] > 0, lambda: apply_penalties(raw, penalties), lambda: raw)
            return jax.lax.cond(flags[1] > 0, lambda: mask_logits(adj, allowed), lambda: adj)

        adjusted = rowwise(adjust, raw, penalties, allowed, invariant=batch_invariant)
        sample = _row_sampler(
            x,
            None,
            None,
            invariant=batch_invariant,
            greedy_only=False,
            cpu_kernel=cpu_kernel,
            sort_free=sort_free,
        )
        toks, _ = sample(adjusted, x["out_pos"])
        lps = rowwise(
            lambda r, t: raw_logprobs(r, t, cpu_kernel=cpu_kernel),
            raw,
            toks,
            invariant=batch_invariant,
        )
        R, C = raw.shape[0], candidates
        cand = jax.lax.cond(
            flags[2] > 0,
            lambda: beam_candidates(raw, C, cand_allowed),
            lambda: (jnp.full((R, C), -jnp.inf, jnp.float32), jnp.zeros((R, C), jnp.int32)),
        )
        out = StepOutputs(tokens=toks, logprobs=lps, cand_logprobs=cand[0], cand_ids=cand[1])
        return out.map(replicated)

    return sample_extras


class ExtrasSampler:
    """The extras samplers of one engine: ``sample`` dispatches one on a step's logits,
    ``warm`` compiles the one of a row count. ``mesh``, ``sort_free``: the engine's;
    ``max_model_len`` fixes the penalty histories' width (its bucket), ``vocab_size``
    the masks'; ``batch_invariant``: the engine's deterministic mode; ``record(bucket)``
    is told of each program compiled (the engine's ``compiled_buckets``);
    ``max_width``: the most sequences a request may have (``n`` or ``beam_width``: the
    engine's ``max_num_seqs``), which fixes the second program's widths.

    ``widths``: ``(samples, candidates)`` of each program a row count has: ``(16, 32)``,
    and where the engine takes wider requests, ``(bucket(max_width), bucket(2 *
    max_width))`` as well; a step takes the first that holds its rows."""

    def __init__(self, mesh, sort_free, *, max_model_len: int, vocab_size: int,
                 batch_invariant: bool, record, max_width: int = EXTRAS_SAMPLES):  # fmt: skip
        self.mesh, self.sort_free = mesh, sort_free
        self.max_model_len, self.vocab_size = max_model_len, vocab_size
        self.batch_invariant, self.record = batch_invariant, record
        self.widths = [(EXTRAS_SAMPLES, EXTRAS_CANDIDATES)]
        wide = (bucket(max_width), bucket(2 * max_width))
        if wide[0] > EXTRAS_SAMPLES or wide[1] > EXTRAS_CANDIDATES:
            self.widths.append((max(wide[0], EXTRAS_SAMPLES), max(wide[1], EXTRAS_CANDIDATES)))
        self._neutral_cache: dict[int, dict] = {}

    def width(self, samples: int, candidates: int) -> tuple[int, int] | None:
        """The ``(samples, candidates)`` program that holds rows of ``samples`` samples and
        ``candidates`` candidates, or None (the step then compiles a variant of its own)."""
        return next((w for w in self.widths if samples <= w[0] and candidates <= w[1]), None)

    def sample(self, ex: ExtrasSample, allowed, cand_allowed) -> Dispatched:
        """Dispatches the extras sampler on ``ex``'s logits: its penalties widened to the
        sampler's fixed widths, absent extras as neutral arrays kept on the device."""
        R = ex.sampling.temperature.shape[0]
        neutral = self._neutral(R)
        penalties, has_penalties = neutral["penalties"], ex.penalties is not None
        if has_penalties:
            penalties = self._widen(ex.penalties, R, neutral["penalties"])
        flags = np.array([has_penalties, allowed is not None, ex.num_candidates > 0], np.int32)
        J = ex.sampling.seeds.shape[1]
        width = self.width(J, ex.num_candidates)
        if width is None:
            raise ValueError(
                f"the extras sampler holds at most {self.widths[-1]} (samples, candidates) "
                f"a row, got {(J, ex.num_candidates)}"
            )
        columns, layout = pack_columns(ex.sampling.with_samples(width[0]))
        mask = lambda m: neutral["mask"] if m is None else jnp.asarray(m)  # noqa: E731
        fn = _make_extras_sample(self.mesh, self.sort_free, width[1])
        before = fn._cache_size()
        t = time.perf_counter()
        with mesh_context(self.mesh):
            out = fn(
                ex.logits, columns, penalties, mask(allowed), mask(cand_allowed), flags,
                layout=layout, batch_invariant=ex.batch_invariant,
            )  # fmt: skip
        seconds = time.perf_counter() - t
        out.tokens, out.logprobs = out.tokens[:, :J], out.logprobs[:, :J]
        C = ex.num_candidates
        if C:
            out.cand_logprobs, out.cand_ids = out.cand_logprobs[:, :C], out.cand_ids[:, :C]
        else:
            out.cand_logprobs = out.cand_ids = None
        out.scores = ex.scores
        compiled = fn._cache_size() > before
        if compiled:
            b = dict(tokens=0, seqs=R, pages_per_seq=0, copies=0, beam_candidates=0)
            b |= dict(seconds=round(seconds, 2), variant=("the extras sampler", *width))
            self.record(b)
            log.info("compiled the extras sampler of %d rows %s in %.1f s", R, width, seconds)
        return Dispatched(out, seconds, compiled)

    def warm(self, rows: int) -> int:
        """Compiles (or loads) the extras samplers of ``rows`` sampling rows, one per
        width, and waits for them; returns how many compiled."""
        V = self.vocab_size
        compiled = 0
        for samples, candidates in self.widths:
            ex = ExtrasSample(
                jnp.zeros((rows, V), jnp.float32), SamplingColumns.idle(rows, samples), None,
                candidates, self.batch_invariant,
            )  # fmt: skip
            d = self.sample(ex, None, None)
            jax.block_until_ready(d.outputs.tokens)
            compiled += d.compiled
        return compiled

    def _neutral(self, rows: int) -> dict:
        """The extras sampler's inputs of ``rows`` rows that change nothing (penalties,
        biases, an every-token mask), made once per row count and kept on the device."""
        cache = self._neutral_cache
        if rows not in cache:
            W, B = bucket(self.max_model_len, 8), EXTRAS_BIASES
            V = self.vocab_size

            def full(name, *shape):
                dtype = jnp.float32 if isinstance(_NEUTRAL[name], float) else jnp.int32
                return jnp.full((rows, *shape), _NEUTRAL[name], dtype)

            cache[rows] = dict(
                penalties=Penalties(
                    full("repetition"),
                    full("presence"),
                    full("frequency"),
                    full("output_tokens", W),
                    full("prompt_tokens", W),
                    full("bias_tokens", B),
                    full("bias_values", B),
                ),
                mask=jnp.full((rows, -(-V // 32)), -1, jnp.int32),
            )
        return cache[rows]

    def _widen(self, pen: Penalties, rows: int, neutral: Penalties) -> Penalties:
        """``pen`` (host arrays, the launcher's widths) at the extras sampler's widths and
        ``rows`` rows, padded with each field's neutral value; absent biases neutral."""
        out = {}
        for f in dataclasses.fields(pen):
            a, like = getattr(pen, f.name), getattr(neutral, f.name)
            if a is None:
                out[f.name] = like
                continue
            wide = np.full(like.shape, _NEUTRAL[f.name], a.dtype)
            wide[tuple(slice(0, n) for n in a.shape)] = a
            out[f.name] = jnp.asarray(wide)  # (as the neutral ones: one jit dispatch key)
        return Penalties(**out)

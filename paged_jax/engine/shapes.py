"""The step shapes an engine configuration can reach: the set ``LLM.warm_up()`` compiles
before serving, so that nothing compiles afterwards. No JAX here.

A step's compiled shape is fixed by its buckets (``paged_jax.batch.build_batch``): ``T``
tokens, ``S`` sequence rows, ``M`` pages per row of the block table, plus whether every
row decodes one token (``decode_only``, which picks the decode kernels) and, for a
multi-step launch, its ``steps``. Within one configuration:

- ``T`` is a power of two from ``min_tokens`` up to the bucket of
  ``max_num_batched_tokens`` (a step never schedules more tokens than that);
- ``S`` is a power of two from the fewest rows a step of ``T`` tokens pads to
  (``min_seqs(T)``, the engine's ``Launching._min_seqs``) up to the bucket of
  ``max_num_seqs``, and never more than ``T`` (every row has a token);
- ``M`` is one width: once warmed up, the engine pads every block table to the pages of
  ``max_model_len`` (the kernels read only a row's own pages, so the width costs the
  table's bytes and nothing else);
- a decode-only step has ``T == S``; a step with a prefill chunk any ``(T, S)`` above,
  ``T == S`` included (a few decode rows and a short chunk);
- a multi-step launch (``num_scheduler_steps > 1``) decodes one token a row: ``T == S``.
- batch-invariant (``deterministic``) steps never take the decode kernels.

With speculative decoding, warm-up also runs each shape that is not decode-only as a
verify step (``min(T, S * k)`` more sampling rows, ``k`` the proposals a row may take:
``speculative.num_verify_rows``).

Rows with penalties, logit biases, ``min_tokens``, ``allowed_token_ids``, structured
output, ``top_logprobs``, beam search or ``n`` samples take these shapes' programs too:
with static shapes their extras are sampled apart, by one program a row count (two where
``max_num_seqs`` is over 16: ``engine/extras.py``, which warm-up compiles as well), and a
fork's copy-on-write copies beyond a step's 8 run apart (``ModelRunner._copies_apart``).
Prompt log-probs add inputs of their own to a step: with static shapes their steps all
take the widest shape that prefills, whose scoring program warm-up compiles beside it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from paged_jax.batch import bucket

# The smallest token bucket of a step (docs/DECISIONS.md, "the smallest step"). Never 1:
# XLA turns a one-row scatter into an update that copies the whole KV pool.
MIN_STEP_TOKENS = 8


@dataclasses.dataclass(frozen=True, order=True)
class StepShape:
    """One compiled step: ``tokens`` (T), ``seqs`` (S) and ``pages_per_seq`` (M) per
    data-parallel replica, ``decode_only``, and ``steps`` decode steps per launch (1: a
    single step)."""

    tokens: int
    seqs: int
    pages_per_seq: int
    decode_only: bool
    steps: int = 1


def _powers(lo: int, hi: int) -> list[int]:
    """Powers of two in ``[lo, hi]`` (``lo`` a power of two)."""
    out = []
    n = lo
    while n <= hi:
        out.append(n)
        n *= 2
    return out


def step_shapes(
    *,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    pages_per_seq: int,
    min_tokens: int,
    min_seqs: Callable[[int], int],
    deterministic: bool = False,
    num_scheduler_steps: int = 1,
) -> list[StepShape]:
    """Every step shape a configuration reaches (see the module docstring), smallest
    first. ``min_seqs(T)``: the fewest sequence rows a step of ``T`` tokens pads to;
    ``deterministic``: batch-invariant steps, which never take the decode kernels."""
    t_max = bucket(max_num_batched_tokens, min_tokens)
    s_max = bucket(max_num_seqs, min_seqs(1))
    shapes = set()
    for T in _powers(bucket(min_tokens), t_max):
        for S in _powers(min_seqs(T), min(T, s_max)):
            shapes.add(StepShape(T, S, pages_per_seq, False))
            if T != S:
                continue
            decode = not deterministic  # batch-invariant steps take one path
            shapes.add(StepShape(T, S, pages_per_seq, decode))
            if num_scheduler_steps > 1:
                shapes.add(StepShape(T, S, pages_per_seq, decode, num_scheduler_steps))
    return sorted(shapes)

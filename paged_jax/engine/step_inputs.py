"""A step's per-row inputs beside its batch, built on the host from its scheduled rows
(``placed``: ``(batch row, Work)`` pairs): which rows sample and with what
(``sampling_rows``, ``sampling_columns``), the prompt positions scored
(``prompt_rows``), each token's adapter (``adapter_rows``), the allowed-token masks
(``token_masks``) and the penalties (``penalties``). Each is None when no row of the
step needs it, so the step compiles without it. No JAX here."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

import numpy as np

from paged_jax.batch import bucket
from paged_jax.engine.sampling import Penalties, SamplingParams, allowed_bits
from paged_jax.engine.step_types import PromptScoring, SamplingColumns

# {batch row: (params, seeds, output position)} of the rows that sample
SamplingRows = dict


def sampling_rows(placed: list) -> tuple[SamplingRows, int, int]:
    """``(rows, J, C)``: the rows that sample, ``{row: (params, seeds, output
    position)}``; the samples a row draws at most (``J``: ``n`` for the first token of
    ``n`` samples, bucketed); the candidates a row returns at most (``C``: beams, top
    log-probs, bucketed; 0: none)."""
    rows, num_samples, num_cand = {}, 1, 0
    for i, w in placed:
        if not w.sample:
            continue
        g, s, p = w.group, w.seq, w.group.params
        pos = w.stop - s.prompt_len  # output position of the token sampled
        if p.top_logprobs:  # the step's candidates: its most likely tokens
            num_cand = max(num_cand, bucket(p.top_logprobs, 2))
        if p.use_beam_search:
            num_cand = max(num_cand, bucket(2 * p.beam_width, 2))
            rows[i] = (p, [g.seed + s.sample_index], pos)
        elif p.n > 1 and not g.forked:
            rows[i] = (p, [g.seed + j for j in range(p.n)], pos)
            num_samples = max(num_samples, bucket(p.n))
        else:
            rows[i] = (p, [g.seed + s.sample_index], pos)
    return rows, num_samples, num_cand


def sampling_columns(rows: SamplingRows, S_b: int, num_samples: int) -> SamplingColumns:
    """The columns of ``S_b`` rows, ``rows`` filled in (one array write per column, not
    per row), the others idle."""
    cols = SamplingColumns.idle(S_b, num_samples)
    if not rows:
        return cols
    at = list(rows)
    per_row = list(rows.values())
    params = [p for p, _, _ in per_row]
    cols.temperature[at] = [p.temperature for p in params]
    cols.top_k[at] = [p.top_k for p in params]
    cols.top_p[at] = [p.top_p for p in params]
    cols.min_p[at] = [p.min_p for p in params]
    cols.out_pos[at] = [pos for _, _, pos in per_row]
    if num_samples == 1:
        cols.seeds[at, 0] = [seed_row[0] for _, seed_row, _ in per_row]
    else:
        for i, (_, seed_row, _) in rows.items():
            cols.seeds[i, : len(seed_row)] = seed_row
    return cols


def distinct_params(rows: SamplingRows) -> list[SamplingParams]:
    """The rows' distinct params (requests share params objects)."""
    return list({id(p): p for p, _, _ in rows.values()}.values())


# The top tokens a prompt-scoring step computes with static shapes (``MAX_TOP_LOGPROBS``,
# bucketed): one program a step shape, whatever ``prompt_logprobs`` asks.
STATIC_SCORE_TOP = 32


def prompt_rows(
    batch, placed: list, static: bool = False
) -> tuple[PromptScoring | None, list | None]:
    """``(scoring, groups)``: the token rows of the step whose logits score the next
    prompt token (requests with ``SamplingParams.prompt_logprobs``), padded to ``E_b``
    (a power of two >= 8), with the most top tokens a request asks (rounded up to a
    power of two, or 0); and ``[(group, positions)]`` in the rows' order; ``(None,
    None)`` when no request of the step asks. ``static`` (static shapes, which warm-up
    compiled): ``E_b`` is the step's token bucket and the top tokens ``STATIC_SCORE_TOP``,
    one scoring program per step shape. Prompt token t (t < prompt length - 1) is
    scored by its own row, unless a completed step has already scored it (a recompute
    after a preemption); a group's sequences computing the same prompt (forks
    recomputed) are scored once."""
    rows, targets, scoring, top = [], [], [], 0
    seen = set()
    for i, w in placed:
        g = w.group
        if g.prompt_lp is None:  # (most rows: one attribute read a step)
            continue
        stop = min(w.stop, len(g.prompt) - 1)
        if w.start >= stop or id(g) in seen:
            continue
        seen.add(id(g))
        first = int(batch.logits_indices[i]) - (w.stop - w.start) + 1  # row of w.start
        ts = [t for t in range(w.start, stop) if g.prompt_lp[t + 1] is None]
        if not ts:
            continue
        rows += [first + t - w.start for t in ts]
        targets += [g.prompt[t + 1] for t in ts]
        scoring.append((g, ts))
        top = max(top, g.params.prompt_logprobs)
    if not rows:
        return None, None
    E_b = batch.token_ids.shape[0] if static else bucket(len(rows), 8)
    at = np.zeros(E_b, np.int32)
    at[: len(rows)] = rows
    to = np.zeros(E_b, np.int32)
    to[: len(rows)] = targets
    if static:
        return PromptScoring(at, to, STATIC_SCORE_TOP), scoring
    return PromptScoring(at, to, bucket(top, 2) if top else 0), scoring


def keep_scores(scoring: list, scores: tuple) -> None:
    """Stores a step's prompt scores (``HostOutputs.scores``) with their requests:
    ``scoring`` lists ``(group, positions)``, the rows in order, position t's row
    scoring prompt token t + 1."""
    lp, top_v, top_i = scores
    j = 0
    for g, ts in scoring:
        k = g.params.prompt_logprobs
        for t in ts:
            g.prompt_lp[t + 1] = float(lp[j])
            if k:
                g.prompt_top[t + 1] = list(
                    zip(top_i[j, :k].tolist(), top_v[j, :k].tolist(), strict=True)
                )
            j += 1


def adapter_rows(batch, placed: list, slot: dict[int, int]) -> np.ndarray:
    """``i32[T_b]``: each token's adapter slot (``slot[Group.adapter]``; 0 for padding
    and rows without one)."""
    out = np.zeros(batch.token_ids.shape[0], np.int32)
    for i, w in placed:
        if w.group.adapter:  # the row's tokens end at its logits row (global rows)
            last = int(batch.logits_indices[i])
            out[last - (w.stop - w.start) + 1 : last + 1] = slot[w.group.adapter]
    return out


def token_masks(
    placed: list,
    rows: SamplingRows,
    S_b: int,
    params: Iterable[SamplingParams],
    vocab: int,
    fill_grammars: Callable,
) -> tuple[np.ndarray | None, np.ndarray | None]:
    """``(allowed, cand_allowed)``, each ``i32[S_b, ceil(V / 32)]`` or None.
    ``allowed``: each sampling row's allowed tokens as a bitmask (``sample_rows``'
    ``allowed``; every token for rows without a restriction), or None when no row has
    one: a grammar's (``SamplingParams.structured``, filled by ``fill_grammars(pairs,
    masks)`` for the ``(matcher, row)`` pairs of the step's constrained rows) and
    ``SamplingParams.allowed_token_ids``. ``cand_allowed``: the same
    rows for beams under a grammar (their candidates, ``beam_candidates``), every token
    for other rows (whose candidates are the model's ``top_logprobs``), or None when no
    beam has a grammar. ``params``: the rows' distinct params."""
    if all(p.allowed_token_ids is None and p.structured is None for p in params):
        return None, None
    masks = np.full((S_b, -(-vocab // 32)), -1, np.int32)  # every bit set
    seqs = {i: w for i, w in placed if i in rows}
    # the grammars' next tokens (structured.py), every row at once (in parallel); a
    # sequence that ended in the step this one overlapped keeps every bit (its row's
    # sample is dropped)
    fill_grammars(
        [
            (seqs[i].group.matchers[seqs[i].seq.seq_id], i)
            for i, (p, _, _) in rows.items()
            if p.structured is not None and seqs[i].seq.finish_reason is None
        ],
        masks,
    )
    for i, (p, _, _) in rows.items():
        if p.allowed_token_ids is not None:
            masks[i] &= _allowed_row(p.allowed_token_ids, vocab)
    beams = [i for i, (p, _, _) in rows.items() if p.use_beam_search and p.structured]
    if not beams:
        return masks, None
    cand = np.full_like(masks, -1)
    cand[beams] = masks[beams]
    return masks, cand


def penalties(
    placed: list, rows: SamplingRows, S_b: int, params: Iterable[SamplingParams], eos: set
) -> Penalties | None:
    """Penalty inputs of the step's sampling rows, or None when no row uses them. Token
    arrays are padded with -1 to power-of-two widths; the logit biases' arrays exist only
    when some row has one. ``params``: the rows' distinct params; ``eos``: the model's
    end-of-sequence tokens."""
    if not any(p.penalized for p in params):
        return None
    seqs = {i: w.seq for i, w in placed if i in rows}
    O_b = bucket(max(len(s.output) for s in seqs.values()), 8)
    P_b = bucket(max(s.prompt_len for s in seqs.values()), 8)
    out = np.full((S_b, O_b), -1, np.int32)
    prompt = np.full((S_b, P_b), -1, np.int32)
    rep = np.ones(S_b, np.float32)
    pres = np.zeros(S_b, np.float32)
    freq = np.zeros(S_b, np.float32)
    bias_tokens, bias_values = _biases(rows, seqs, S_b, eos)
    for i, (p, _, _) in rows.items():
        if not p.penalized:
            continue
        s = seqs[i]
        out[i, : len(s.output)] = s.output
        prompt[i, : s.prompt_len] = s.tokens[: s.prompt_len]
        rep[i], pres[i], freq[i] = p.repetition_penalty, p.presence_penalty, p.frequency_penalty
    # (the runner puts them on the device)
    return Penalties(rep, pres, freq, out, prompt, bias_tokens, bias_values)


def _biases(rows: SamplingRows, seqs: dict, S_b: int, eos: set) -> tuple:
    """``(i32[S_b, B_b], f32[S_b, B_b])``, each row's logit bias: its own, and -inf on the
    tokens that would stop it while it has fewer than min_tokens
    (``SamplingParams.min_tokens``); ``(None, None)`` when no row has one."""
    biases = {}
    for i, (p, _, _) in rows.items():
        bias = list(p.logit_bias or ())
        if p.min_tokens and len(seqs[i].output) < p.min_tokens:
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else eos)
            bias += [(t, -np.inf) for t in sorted(stops)]
        if bias:
            biases[i] = bias
    if not biases:
        return None, None
    B_b = bucket(max(map(len, biases.values())), 8)
    bias_tokens = np.full((S_b, B_b), -1, np.int32)
    bias_values = np.zeros((S_b, B_b), np.float32)
    for i, bias in biases.items():
        ids, values = zip(*bias, strict=True)
        bias_tokens[i, : len(ids)] = ids
        bias_values[i, : len(ids)] = values
    return bias_tokens, bias_values


@functools.lru_cache(maxsize=256)
def _allowed_row(token_ids: tuple[int, ...], vocab: int) -> np.ndarray:
    """``allowed_bits``, once per distinct set of allowed tokens (read only)."""
    row = allowed_bits(token_ids, vocab)
    row.setflags(write=False)
    return row

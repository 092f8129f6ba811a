"""Structured output (issue 54): masks against a brute force over the vocabulary, every
output parsing and matching its schema, expression, choice or grammar through the engine
(greedy, sampled, n = 2, a pool tight enough to preempt, prefix hits), and the errors."""

import json
import re

import numpy as np
import pytest
from test_gguf import _model, write_gguf

import paged_jax as pj
from paged_jax.engine.structured import StructuredOutput
from paged_jax.models import load_gguf

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "kind": {"enum": ["cat", "dog"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
    },
    "required": ["id", "kind", "tags"],
    "additionalProperties": False,
}


def _valid(out: dict) -> bool:
    return (
        set(out) == {"id", "kind", "tags"}
        and isinstance(out["id"], int)
        and 0 <= out["id"] <= 999
        and out["kind"] in ("cat", "dog")
        and isinstance(out["tags"], list)
        and len(out["tags"]) <= 2
        and all(isinstance(t, str) and len(t) <= 3 for t in out["tags"])
    )


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """A random GGUF model with a byte-level vocabulary of 300 tokens (a real tokenizer),
    on a pool small enough that 8 long requests preempt one another."""
    path = tmp_path_factory.mktemp("structured") / "m.gguf"
    write_gguf(path, _model(vocab_size=300))
    model, tok = load_gguf(path)
    return model, tok


def _llm(engine, **kw):
    model, tok = engine
    return pj.LLM(model, tok, page_size=8, compilation_cache=False, **dict(num_pages=128) | kw)


def test_the_mask_is_what_the_grammar_accepts_token_by_token(engine):
    # Every token of the vocabulary, at each position of a valid output: its bit is set
    # exactly when the matcher takes it.
    from paged_jax.engine.structured import Grammars

    model, tok = engine
    vocab = model.config.vocab_size
    grammars = Grammars(tok, eos=None, vocab=vocab)
    spec = StructuredOutput(regex=r"(ab|c)[0-9]{1,2}")
    m = grammars.matcher(spec)
    for t in tok.encode("ab7", add_special_tokens=False).ids:
        masks = np.zeros((2, -(-vocab // 32)), np.int32)
        grammars.fill(m, masks, 1)
        assert not masks[0].any()
        bits = (masks[1].view(np.uint32)[np.arange(vocab) // 32] >> (np.arange(vocab) % 32)) & 1
        for v in range(vocab):
            took = m.deep_copy().consume_token(v)
            assert bool(bits[v]) == bool(took), (t, v)
        assert bits[t]
        m.consume_token(t)


def test_a_step_s_rows_fill_together_as_each_alone(engine):
    # fill_rows (llguidance's parallel fill, every constrained row of a step at once):
    # each row as fill writes it alone, the other rows untouched, matchers at different
    # points of different constraints
    from paged_jax.engine.structured import Grammars

    model, tok = engine
    vocab = model.config.vocab_size
    grammars = Grammars(tok, eos=None, vocab=vocab)
    specs = [StructuredOutput(regex=r"(ab|c)[0-9]{1,2}"), StructuredOutput(regex=CODE)]
    pairs = []
    for k in range(40):  # (from PARALLEL_ROWS rows on, the thread pool's way)
        m = grammars.matcher(specs[k % 2])
        text = ("ab7", "bc-12")[k % 2][: k % 6 // 2 + 1]
        for t in tok.encode(text, add_special_tokens=False).ids:
            assert m.consume_token(t)
        pairs.append((m, 2 * k + 1))  # odd rows; the even ones keep their bits
    from paged_jax.engine.structured import PARALLEL_ROWS

    assert len(pairs) >= PARALLEL_ROWS
    together = np.full((81, -(-vocab // 32)), -1, np.int32)
    grammars.fill_rows(pairs, together)
    alone = np.full_like(together, -1)
    for m, row in pairs:
        grammars.fill(m, alone, row)
    np.testing.assert_array_equal(together, alone)
    assert (together[::2] == -1).all() and len({together[r].tobytes() for _, r in pairs}) > 2


def test_every_output_follows_its_constraint_through_the_engine(engine):
    # Greedy, sampled and n = 2 rows with a JSON schema (as a dict and as text), a regex,
    # a choice and a Lark grammar in one batch, twice (the second time from the prefix
    # cache), on a pool tight enough to preempt: every output parses and matches, ends
    # with "stop", and greedy outputs are the same both times.
    llm = _llm(engine, num_pages=40)
    specs = [
        StructuredOutput(json=SCHEMA),
        StructuredOutput(json=json.dumps(SCHEMA)),
        StructuredOutput(regex=r"[a-c]{2}-[0-9]{3}"),
        StructuredOutput(choice=["red", "green", "blue"]),
        StructuredOutput(grammar='start: "(" NUM ("," NUM)* ")"\nNUM: /[0-9]{1,2}/'),
    ]
    params = []
    for i, spec in enumerate(specs):
        params.append(pj.SamplingParams(max_tokens=70, structured=spec))  # greedy
        params.append(
            pj.SamplingParams(max_tokens=70, temperature=1.0, seed=i, n=2, structured=spec)
        )
    prompts = [f"request {i} " * 6 for i in range(len(params))]
    runs = [llm.generate(prompts, params, progress=False) for _ in range(2)]
    assert llm.metrics.preemptions_swap + llm.metrics.preemptions_recompute > 0
    for outs in runs:
        for spec_i, o in enumerate(outs):
            spec = specs[spec_i // 2]
            for c in o.outputs:
                assert c.finish_reason == "stop", (spec.kind, c.text)
                text = c.text
                if spec.kind == "json":
                    assert _valid(json.loads(text)), text
                elif spec.kind == "regex":
                    assert re.fullmatch(r"[a-c]{2}-[0-9]{3}", text), text
                elif spec.kind == "choice":
                    assert text in ("red", "green", "blue"), text
                else:
                    assert re.fullmatch(r"\(\d{1,2}(,\d{1,2})*\)", text), text
    greedy = slice(0, None, 2)
    assert [o.outputs[0].text for o in runs[0][greedy]] == [
        o.outputs[0].text for o in runs[1][greedy]
    ]
    assert runs[1][0].metrics.num_cached_tokens > 0


def test_overlapped_constrained_steps_give_the_tokens_of_one_step_at_a_time(engine):
    # With overlap on, a constrained row's next step runs its model before the row's
    # token is known and is sampled once its mask is filled (Launched.deferred). Its
    # tokens equal those of steps run one at a time, greedy and seeded, across grammars,
    # a request admitted mid-run and rows that finish while the next step runs.
    specs = [
        StructuredOutput(json=SCHEMA),
        StructuredOutput(regex=r"[a-c]{2}-[0-9]{3}"),
        StructuredOutput(choice=["red", "green", "blue"]),
        None,  # a free row in the same steps
    ]
    params = [
        pj.SamplingParams(max_tokens=40, temperature=t, seed=7 * i, structured=spec)
        for i, spec in enumerate(specs)
        for t in (0.0, 1.0)
    ]
    prompts = [f"case {i} " * (3 + i) for i in range(len(params))]
    runs = {}
    for overlap in (True, False):
        llm = _llm(engine, async_scheduling=overlap)
        got = {}
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            llm.add_request(i, prompt, p)
            if i == 3:  # the rest join while the first ones decode
                for _ in range(3):
                    for o in llm.step():
                        got[o.request_id] = o
        while llm.has_unfinished():
            for o in llm.step():
                got[o.request_id] = o
        runs[overlap] = [got[i].outputs[0].token_ids for i in range(len(params))]
        if overlap:
            assert llm.metrics.overlapped_steps > 10, llm.metrics.overlapped_steps
        else:
            assert llm.metrics.overlapped_steps == 0
    assert runs[True] == runs[False]
    for i, toks in enumerate(runs[True]):
        spec = specs[i // 2]
        if spec is not None and spec.kind == "choice":
            assert engine[1].decode(toks) in ("red", "green", "blue")


CODE = r"[a-c]{2}-[0-9]{3}"


def test_beam_search_keeps_a_grammar_state_per_beam(engine):
    # Each beam forks its parent's matcher and takes its own token: every beam returned
    # follows the constraint and ends with "stop", the beams differ, and they come best
    # first (log-prob per token, length_penalty 1). A choice of two strings allows fewer
    # tokens than the 2 x 3 candidates a step keeps: the -inf candidates are never taken.
    llm = _llm(engine)
    cases = [
        (StructuredOutput(regex=CODE), lambda t: re.fullmatch(CODE, t)),
        (StructuredOutput(json=SCHEMA), lambda t: _valid(json.loads(t))),
        (StructuredOutput(choice=["red", "blue"]), lambda t: t in ("red", "blue")),
    ]  # fmt: skip
    params = [pj.SamplingParams(max_tokens=70, beam_width=3, n=3, structured=s) for s, _ in cases]
    outs = llm.generate([f"beam {i} " * 5 for i in range(3)], params, progress=False)
    for (spec, ok), o in zip(cases, outs, strict=True):
        texts = [c.text for c in o.outputs]
        assert texts and len(set(texts)) == len(texts), (spec.kind, texts)
        for c in o.outputs:
            assert c.finish_reason == "stop" and ok(c.text), (spec.kind, c.text)
        scores = [c.cumulative_logprob / len(c.token_ids) for c in o.outputs]
        assert all(np.isfinite(scores)) and scores == sorted(scores, reverse=True)
    assert len(outs[0].outputs) == 3 and len(outs[2].outputs) <= 2


def test_bad_constraints_are_named():
    with pytest.raises(ValueError, match="structured: expected exactly one of json, "):
        StructuredOutput(json={}, regex="a")
    with pytest.raises(ValueError, match="got none"):
        StructuredOutput()
    with pytest.raises(TypeError, match="structured.choice: expected a list of non-empty"):
        StructuredOutput(choice="abc")
    with pytest.raises(TypeError, match="structured: expected a StructuredOutput, got dict"):
        pj.SamplingParams(structured={"json": {}})


def test_a_schema_or_grammar_the_library_refuses_is_a_value_error_on_add(engine):
    llm = _llm(engine)
    bad = [
        (StructuredOutput(json={"type": "nonsense"}), "params.structured.json: "),
        (StructuredOutput(regex="(unclosed"), "params.structured.regex: "),
        (StructuredOutput(grammar="start: undefined_rule"), "params.structured.grammar: "),
    ]
    for spec, words in bad:
        with pytest.raises(ValueError, match=re.escape(words)):
            llm.add_request("r", "hi", pj.SamplingParams(structured=spec))
    assert not llm.has_unfinished()
    no_tok = pj.LLM(engine[0], None, num_pages=32, page_size=8, compilation_cache=False)
    with pytest.raises(ValueError, match="structured output needs a tokenizer"):
        no_tok.add_request("r", [1, 2], pj.SamplingParams(structured=StructuredOutput(regex="a")))


def test_any_json_object_accepts_objects_only(engine):
    # json_object: random weights write keys without end, so the matcher alone: an
    # object is taken and completes the output; an array is refused at its first token.
    from paged_jax.engine.structured import Grammars

    model, tok = engine
    grammars = Grammars(tok, eos=None, vocab=model.config.vocab_size)
    m = grammars.matcher(StructuredOutput(json_object=True))
    for t in tok.encode('{"a": [1, "b"]}', add_special_tokens=False).ids:
        assert m.consume_token(t)
    assert m.is_accepting()
    m = grammars.matcher(StructuredOutput(json_object=True))
    assert not m.consume_token(tok.encode("[", add_special_tokens=False).ids[0])


# Held-out schemas (written for this test, not used to build the grammar code): nested
# objects and arrays, enums and consts, bounded numbers and strings, optional and
# nullable fields, anyOf, patterns. Every output is checked by jsonschema, a validator
# independent of llguidance.
HELD_OUT = [
    {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "minLength": 1, "maxLength": 5},
                    "age": {"type": "integer", "minimum": 18, "maximum": 30},
                },
                "required": ["name", "age"],
                "additionalProperties": False,
            },
            "roles": {
                "type": "array",
                "items": {"enum": ["admin", "dev", "ops"]},
                "minItems": 1,
                "maxItems": 3,
            },
        },
        "required": ["user", "roles"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "kind": {"const": "point"},
            "xy": {
                "type": "array",
                "items": {"type": "number", "minimum": -1, "maximum": 1},
                "minItems": 2,
                "maxItems": 2,
            },
            "label": {"type": ["string", "null"], "maxLength": 4},
        },
        "required": ["kind", "xy", "label"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
            "ok": {"type": "boolean"},
            "note": {"type": "string", "maxLength": 3},
        },
        "required": ["code", "ok"],
        "additionalProperties": False,
    },
    {
        "anyOf": [
            {
                "type": "object",
                "properties": {"n": {"type": "integer", "multipleOf": 5, "maximum": 50}},
                "required": ["n"],
                "additionalProperties": False,
            },
            {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
        ]
    },
]


@pytest.mark.parametrize("k", range(len(HELD_OUT)))
def test_held_out_schemas_validate_with_jsonschema(engine, k):
    import jsonschema  # (the test extra has it)

    schema = HELD_OUT[k]
    jsonschema.Draft202012Validator.check_schema(schema)
    llm = _llm(engine)
    params = [
        pj.SamplingParams(
            max_tokens=160,
            temperature=t,
            seed=s,
            structured=StructuredOutput(json=schema),
        )
        for t, s in ((0.0, 0), (1.0, 1), (1.0, 2), (0.7, 3))
    ]
    outs = llm.generate(["{", "a", "b", "c"], params, progress=False)
    for o in outs:
        c = o.outputs[0]
        assert c.finish_reason == "stop", (k, c.text)
        jsonschema.validate(json.loads(c.text), schema)


@pytest.mark.parametrize(
    "spec,think,good,bad",
    [
        (
            dict(json=SCHEMA),
            "inside",
            'hm, {"id": 1}\n</think>\n\n{"id": 5, "kind": "cat", "tags": []}',
            ['{"id": 5}', 'x</think>{"id": 5, "kind": "cow", "tags": []}'],
        ),
        (
            dict(json=SCHEMA),
            "optional",
            '<think>\nno\n</think>\n\n{"id": 7, "kind": "dog", "tags": ["a"]}',
            ['Sure! {"id": 7}', '<think>a</think>"x"'],
        ),
        (dict(json=SCHEMA), "optional", '{"id": 7, "kind": "dog", "tags": []}', ["<thin>"]),
        (dict(regex=r"a/b[0-9]+"), "inside", "</think>a/b42", ["a/b42", "</think>a/c1"]),
        (
            dict(choice=["yes", 'no "way"']),
            "optional",
            '<think>?</think> no "way"',
            ["maybe", "<think>x</think>maybe"],
        ),
        (dict(grammar='start: "x" | "y" y\ny: "!"'), "inside", "..</think>y!", ["x"]),
    ],
    ids=["json-inside", "json-optional", "json-no-thinking", "regex", "choice", "grammar"],
)
def test_a_constraint_holds_after_the_thinking_block(engine, spec, think, good, bad):
    """``StructuredOutput(think=...)``: free text up to the first ``</think>`` (the prompt
    opened the block, or the output opens it itself), whitespace, then the constraint;
    an output that breaks the constraint after the block, or gives it before, is refused
    at some token."""
    from paged_jax.engine.structured import Grammars

    model, tok = engine
    grammars = Grammars(tok, eos=None, vocab=model.config.vocab_size)

    def takes(text):
        m = grammars.matcher(StructuredOutput(**spec, think=think))
        ok = all(m.consume_token(t) for t in tok.encode(text, add_special_tokens=False).ids)
        return ok and m.is_accepting()

    assert takes(good)
    for text in bad:
        assert not takes(text), text
    with pytest.raises(ValueError, match="structured.think: expected None, 'inside' or"):
        StructuredOutput(regex="a", think="always")


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_constrained_requests_compile_nothing_after_warm_up(engine, async_scheduling):
    # After warm-up a grammar's rows sample in the extras sampler (overlapped: once the
    # running step's token reached the matcher): nothing compiles, every output matches,
    # and the tokens are those of an engine that compiles its variants as they come.
    kw = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256)
    llm = _llm(engine, async_scheduling=async_scheduling, **kw)
    n = len(llm.warm_up(progress=False))
    specs = [
        StructuredOutput(json=SCHEMA),
        StructuredOutput(regex=CODE),
        StructuredOutput(choice=["red", "green", "blue"]),
    ]
    params = [pj.SamplingParams(max_tokens=60, structured=s) for s in specs]
    params += [
        pj.SamplingParams(max_tokens=60, temperature=1.0, seed=i, structured=s)
        for i, s in enumerate(specs)
    ]
    params.append(pj.SamplingParams(max_tokens=60, beam_width=2, n=2, structured=specs[1]))
    params.append(
        pj.SamplingParams(max_tokens=60, temperature=1.0, seed=5, n=2, structured=specs[0])
    )
    params.append(pj.SamplingParams(max_tokens=20, temperature=0.8, seed=9))  # unconstrained
    prompts = [f"warm {i} " * 5 for i in range(len(params))]
    got = llm.generate(prompts, params, progress=False)
    assert len(llm.compiled_buckets) == n, llm.compiled_buckets[n:]
    want = _llm(engine, async_scheduling=async_scheduling, **kw).generate(
        prompts, params, progress=False
    )
    for g, w in zip(got, want, strict=True):
        assert [c.token_ids for c in g.outputs] == [c.token_ids for c in w.outputs]
    assert _valid(json.loads(got[0].outputs[0].text)) and re.fullmatch(CODE, got[1].outputs[0].text)

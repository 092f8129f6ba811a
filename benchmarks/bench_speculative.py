"""Speculative decoding by n-gram lookup against plain decoding, on a real model.

``python -m benchmarks speculative [--out DIR] [--concurrency 1 4 16] [--output-len 256]
[--chat-len 128] [--k 4] [--repeats 3]``

Model: SmolLM2-135M-Instruct (``paged_jax.models.load``, f32), two engines in one
process, the same but for ``speculative={"method": "ngram", "num_speculative_tokens":
k}``, their runs alternated, greedy:

- grounded: chat requests that quote or edit a passage of about 300 tokens of their own
  prompt (public-domain passages; instructions to copy, to correct spelling, to put in
  capitals...), ``--concurrency`` requests at once, each up to ``--output-len`` tokens
  (it may end earlier at the model's end token: both engines give the same tokens);
- free-form: chat questions whose answers quote nothing (``--chat-len`` tokens), all at
  once, where proposals rarely match and must cost little.

Both engines are warmed up first (``LLM.warm_up()``, as ``paged-jax serve`` runs before
it takes requests: static shapes, every step shape and verify step compiled), and each
workload runs once untimed on each. Without it the timed rounds compiled steps of their
own: a run's proposals depend on the verifier's calibration from the runs before, so
the verify buckets it reaches differ from the untimed run's (on the Intel Xeon, 1.8 s and
0.6 s of compiling in the speculative engine's first two free-form rounds), and a
repeated run's prompts hit the prefix cache, so its prefill buckets differ too.

Reported: generated tokens/s (min / median / max of ``--repeats``; the engine that
runs first rotates from round to round), the ratio of the medians and each round's,
the acceptance rate and mean accepted length, the engine steps a run took (medians: a
batch sent at once lasts as many steps as its slowest row, whatever the others accept),
whether every output of the two engines was the same, and the seconds either engine
spent compiling in the timed rounds (0 unless a bucket was missed). ``--control`` adds
a second plain engine to every round and reports its ratio to the first
(``control_speedup``, ``control_paired``): what this machine's noise alone makes of two
identical engines.

``python -m benchmarks speculative --verify-cost [--shape llama3-8b] [--concurrency 1 4
16 64] [--ks 1 2 4] [--output-len 64]``: what a verify step costs against a decode step,
on a decoder of a public model's shape with random weights (``bench_engine``'s shapes;
bf16 on an accelerator, f32 on CPU), where a draft would have its proposals rejected.
The proposals are made right instead (the tokens of a run without speculation, as a
perfect draft would propose them), so each step verifies ``k`` tokens per sequence and
keeps them: per concurrency and ``k``, milliseconds a step and tokens/s against ``k =
0`` (plain decoding), medians of ``--repeats``. What speculation can gain on a device is
``(k + 1) / (step cost ratio)`` at full acceptance.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from benchmarks.bench_quantization import TEXT
from benchmarks.common import environment, positive_int, write_result

MODEL = "smollm2-135m-instruct"

# Public-domain passages (US founding documents and Lincoln's speeches).
PASSAGES = [
    "Four score and seven years ago our fathers brought forth on this continent, a new "
    "nation, conceived in Liberty, and dedicated to the proposition that all men are "
    "created equal. Now we are engaged in a great civil war, testing whether that nation, "
    "or any nation so conceived and so dedicated, can long endure. We are met on a great "
    "battle-field of that war. We have come to dedicate a portion of that field, as a "
    "final resting place for those who here gave their lives that that nation might live. "
    "It is altogether fitting and proper that we should do this. But, in a larger sense, "
    "we can not dedicate -- we can not consecrate -- we can not hallow -- this ground. The "
    "brave men, living and dead, who struggled here, have consecrated it, far above our "
    "poor power to add or detract. The world will little note, nor long remember what we "
    "say here, but it can never forget what they did here. It is for us the living, "
    "rather, to be dedicated here to the unfinished work which they who fought here have "
    "thus far so nobly advanced.",
    TEXT + " "  # the Declaration's opening (bench_quantization's text), and more
    "That to secure these rights, Governments are instituted "
    "among Men, deriving their just powers from the consent of the governed, That whenever "
    "any Form of Government becomes destructive of these ends, it is the Right of the "
    "People to alter or to abolish it, and to institute new Government, laying its "
    "foundation on such principles and organizing its powers in such form, as to them "
    "shall seem most likely to effect their Safety and Happiness.",
    "We the People of the United States, in Order to form a more perfect Union, establish "
    "Justice, insure domestic Tranquility, provide for the common defence, promote the "
    "general Welfare, and secure the Blessings of Liberty to ourselves and our Posterity, "
    "do ordain and establish this Constitution for the United States of America. All "
    "legislative Powers herein granted shall be vested in a Congress of the United States, "
    "which shall consist of a Senate and House of Representatives. The House of "
    "Representatives shall be composed of Members chosen every second Year by the People "
    "of the several States, and the Electors in each State shall have the Qualifications "
    "requisite for Electors of the most numerous Branch of the State Legislature. No "
    "Person shall be a Representative who shall not have attained to the Age of twenty "
    "five Years, and been seven Years a Citizen of the United States, and who shall not, "
    "when elected, be an Inhabitant of that State in which he shall be chosen.",
    "With malice toward none, with charity for all, with firmness in the right as God "
    "gives us to see the right, let us strive on to finish the work we are in, to bind up "
    "the nation's wounds, to care for him who shall have borne the battle and for his "
    "widow and his orphan, to do all which may achieve and cherish a just and lasting "
    "peace among ourselves and with all nations. Fondly do we hope, fervently do we pray, "
    "that this mighty scourge of war may speedily pass away. Yet, if God wills that it "
    "continue until all the wealth piled by the bondsman's two hundred and fifty years of "
    "unrequited toil shall be sunk, and until every drop of blood drawn with the lash "
    "shall be paid by another drawn with the sword, as was said three thousand years ago, "
    "so still it must be said that the judgments of the Lord are true and righteous "
    "altogether.",
]

INSTRUCTIONS = [
    "Repeat the following passage exactly, word for word:\n\n{p}",
    "Here is a passage.\n\n{p}\n\nCopy the passage above without changing anything.",
    "Correct any spelling mistakes in this text and return the whole corrected text:\n\n{p}",
    "Rewrite this passage with every sentence on its own line:\n\n{p}",
]

QUESTIONS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are three good habits for learning a new language? Explain each.",
    "Describe how a bicycle works to a ten-year-old.",
    "Give me a recipe for a simple vegetable soup.",
    "Why is the sky blue? Answer in a friendly tone.",
    "Write a poem about autumn leaves.",
    "What should I pack for a weekend hiking trip?",
    "Explain the difference between weather and climate.",
    "Suggest five names for a bakery and explain each one.",
    "How do bees make honey?",
    "Write a letter thanking a teacher.",
    "What are the benefits of drinking water?",
    "Describe a day in the life of a city bus driver.",
    "How can I get better sleep at night?",
    "Tell me about the planets of the solar system.",
    "Write a dialogue between a cat and a dog about breakfast.",
]


def grounded(n: int) -> list[list[dict]]:
    """``n`` chat requests, each an instruction over a passage of its prompt."""
    out = []
    for i in range(n):
        text = INSTRUCTIONS[(i // len(PASSAGES)) % len(INSTRUCTIONS)].format(
            p=PASSAGES[i % len(PASSAGES)]
        )
        out.append([{"role": "user", "content": text}])
    return out


def free_form(n: int) -> list[list[dict]]:
    return [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}] for i in range(n)]


class _Known:
    """Proposes each sequence's true continuation, from ``sequences`` (prompt + output of
    a run without speculation)."""

    def __init__(self, sequences):
        self.by_prompt = {tuple(s[:16]): s for s in sequences}

    def propose(self, requests):
        out = []
        for r in requests:
            t = r.tokens
            s = self.by_prompt[tuple(t[:16].tolist())]
            out.append(s[len(t) : len(t) + r.max_tokens])
        return out


def verify_cost(args) -> int:
    import jax
    import jax.numpy as jnp

    import paged_jax as pj
    from benchmarks.bench_engine import SHAPE_FIELDS, _prompts
    from paged_jax import models

    def say(msg):
        print(f"speculative verify-cost: {msg}", file=sys.stderr, flush=True)

    if args.shape not in SHAPE_FIELDS:
        print(
            f"--shape: expected one of {sorted(SHAPE_FIELDS)}, got {args.shape!r}", file=sys.stderr
        )
        return 2
    cpu = jax.default_backend() == "cpu"
    dtype = jnp.float32 if cpu else jnp.bfloat16
    cfg = models.LlamaConfig(**SHAPE_FIELDS[args.shape])
    model = models.init_model(cfg, seed=0, dtype=dtype, param_dtype=dtype)
    rows = []
    for c in args.concurrency:
        prompts = _prompts(c, 128, cfg.vocab_size, seed=c)
        p = pj.SamplingParams(max_tokens=args.output_len, ignore_eos=True)
        common = dict(max_num_seqs=max(c, 8), max_num_batched_tokens=max(1024, c * 8),
                      compilation_cache=False, async_scheduling=False)  # fmt: skip
        plain = pj.LLM(model, **common)
        want = plain.generate(prompts, p, progress=False)
        sequences = [q + o.outputs[0].token_ids for q, o in zip(prompts, want, strict=True)]
        engines = {0: plain}
        for k in args.ks:
            e = pj.LLM(model, speculative={"num_speculative_tokens": k}, **common)
            e.engine.speculator.proposer = _Known(sequences)
            engines[k] = e
        for e in engines.values():
            e.generate(prompts, p, progress=False)  # compile
        runs = {k: [] for k in engines}
        for _ in range(args.repeats):
            for k, e in engines.items():
                s0 = e.metrics.steps
                t = time.perf_counter()
                outs = e.generate(prompts, p, progress=False)
                dt = time.perf_counter() - t
                assert [o.outputs[0].token_ids for o in outs] == [
                    o.outputs[0].token_ids for o in want
                ], "a verify step changed a token"
                runs[k].append((dt * 1e3 / (e.metrics.steps - s0), c * args.output_len / dt))
        base_ms = statistics.median(x[0] for x in runs[0])
        base_rate = statistics.median(x[1] for x in runs[0])
        for k, r in runs.items():
            ms = statistics.median(x[0] for x in r)
            rate = statistics.median(x[1] for x in r)
            rows.append(dict(concurrency=c, k=k, ms_per_step=round(ms, 3),
                             step_cost_vs_decode=round(ms / base_ms, 3),
                             tokens_per_s=round(rate, 1),
                             speedup=round(rate / base_rate, 3)))  # fmt: skip
            say(f"c={c} k={k}: {ms:.1f} ms a step ({ms / base_ms:.2f}x), {rate:.1f} tokens/s")
    payload = dict(
        environment=environment(with_jax=True),
        command="python -m benchmarks speculative "
        + " ".join(args.argv if args.argv is not None else sys.argv[1:]),
        model=f"{args.shape}-shaped decoder, random weights, {jnp.dtype(dtype).name}",
        workload=dict(prompt_len=128, output_len=args.output_len, repeats=args.repeats),
        proposals="each sequence's true continuation (all accepted)",
        jax=jax.__version__,
        device=str(jax.devices()[0].device_kind),
        results=rows,
    )
    path = write_result("speculative_verify_cost", payload)
    print(f"results: {path}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks speculative")
    ap.add_argument("--verify-cost", action="store_true")
    ap.add_argument("--shape", default="llama3-8b", help="a shape of bench_engine.SHAPE_FIELDS")
    ap.add_argument("--ks", nargs="+", type=positive_int, default=[1, 2, 4])
    ap.add_argument("--concurrency", nargs="+", type=positive_int, default=[1, 4, 16])
    ap.add_argument("--output-len", type=positive_int, default=256)
    ap.add_argument("--chat-len", type=positive_int, default=128)
    ap.add_argument("--chat-requests", type=positive_int, default=16)
    ap.add_argument("--k", type=positive_int, default=4)
    ap.add_argument("--repeats", type=positive_int, default=3)
    ap.add_argument(
        "--control",
        action="store_true",
        help="a second plain engine in every round: the ratio two identical engines make",
    )
    args = ap.parse_args(argv)
    if args.verify_cost:
        args.argv = argv
        if "--output-len" not in (argv if argv is not None else sys.argv[1:]):
            args.output_len = 64
        return verify_cost(args)

    import jax

    import paged_jax as pj
    from paged_jax import models

    def say(msg):
        print(f"speculative: {msg}", file=sys.stderr, flush=True)

    model, tok = models.load(MODEL)
    common = dict(kv_cache_bytes=2**30, compilation_cache=False, max_num_batched_tokens=1024)
    spec = {"method": "ngram", "num_speculative_tokens": args.k}
    engines = {
        "plain": pj.LLM(model, tok, **common),
        "ngram": pj.LLM(model, tok, speculative=spec, **common),
    }
    if args.control:  # the plain engine again: how far two identical engines differ here
        engines["control"] = pj.LLM(model, tok, **common)
    for name, e in engines.items():
        say(f"warming up {name}")
        e.warm_up(progress=False)

    def run(name, convs, max_tokens):
        e = engines[name]
        before = (e.metrics.spec_draft_tokens, e.metrics.spec_accepted_tokens)
        before_rows = e.metrics.spec_verify_rows
        compiled = e.metrics.compile_s
        steps = e.metrics.steps
        p = pj.SamplingParams(max_tokens=max_tokens, temperature=0.0)
        t = time.perf_counter()
        outs = e.chat(convs, p, progress=False)
        dt = time.perf_counter() - t
        toks = [o.outputs[0].token_ids for o in outs]
        m = e.metrics
        drafted = m.spec_draft_tokens - before[0]
        accepted = m.spec_accepted_tokens - before[1]
        rows = m.spec_verify_rows - before_rows
        comp = m.compile_s - compiled
        return toks, sum(map(len, toks)) / dt, drafted, accepted, rows, comp, m.steps - steps

    workloads = [(f"grounded x{c}", grounded(c), args.output_len) for c in args.concurrency]
    workloads.append(
        (f"free-form x{args.chat_requests}", free_form(args.chat_requests), args.chat_len)
    )
    rows = []
    for label, convs, max_tokens in workloads:
        for name in engines:  # compile this workload's buckets first
            run(name, convs, max_tokens)
        runs = {name: [] for name in engines}
        steps = {name: [] for name in engines}
        same, stats, compiling = True, None, dict.fromkeys(engines, 0.0)
        for k in range(args.repeats):
            got = {}
            names = list(engines)  # alternated, the first of a round rotating too
            for name in names[k % len(names) :] + names[: k % len(names)]:
                toks, rate, drafted, accepted, verified, comp, n = run(name, convs, max_tokens)
                compiling[name] += comp
                steps[name].append(n)
                got[name] = toks
                runs[name].append(rate)
                if name == "ngram":
                    stats = (drafted, accepted, verified, sum(map(len, toks)))
                say(f"{label} round {k} {name}: {rate:.1f} tokens/s")
            same &= all(got[n] == got["plain"] for n in engines)
        med = {n: statistics.median(r) for n, r in runs.items()}
        drafted, accepted, verified, generated = stats
        row = dict(
            workload=label,
            requests=len(convs),
            max_tokens=max_tokens,
            generated_tokens=generated,
            same_tokens=same,
            tokens_per_s={
                n: dict(min=min(r), median=statistics.median(r), max=max(r))
                for n, r in runs.items()
            },
            speedup=round(med["ngram"] / med["plain"], 3),
            paired_speedups=[
                round(a / b, 3) for a, b in zip(runs["ngram"], runs["plain"], strict=True)
            ],
            acceptance_rate=round(accepted / max(drafted, 1), 3),
            mean_accepted_length=round((accepted + verified) / verified, 3) if verified else 1.0,
            proposed_tokens=drafted,
            steps={n: statistics.median(k) for n, k in steps.items()},
            compile_s_in_timed_rounds={n: round(c, 3) for n, c in compiling.items()},
        )
        if args.control:
            row["control_speedup"] = round(med["control"] / med["plain"], 3)
            row["control_paired"] = [
                round(a / b, 3) for a, b in zip(runs["control"], runs["plain"], strict=True)
            ]
        rows.append(row)
        print(
            f"{label}: plain {med['plain']:.1f}, ngram {med['ngram']:.1f} tokens/s "
            f"({row['speedup']}x); acceptance {row['acceptance_rate']}, mean accepted "
            f"length {row['mean_accepted_length']}; same tokens: {same}"
            + (f"; control {row['control_speedup']}x" if args.control else "")
        )
    payload = dict(
        environment=environment(),
        command="python -m benchmarks speculative "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        model=f"{MODEL} (f32), greedy, chat template",
        speculative=spec,
        repeats=args.repeats,
        jax=jax.__version__,
        results=rows,
    )
    path = write_result("speculative", payload)
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

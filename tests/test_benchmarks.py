"""The benchmarks' measures on small cases where the answer is known (memory, peers)."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_memory import simulate_paged, simulate_reserved  # noqa: E402
from benchmarks.workloads import WORKLOADS, sample_lengths  # noqa: E402


def test_reserved_effective_memory_hand_worked():
    # One request, prompt 3 + output 2, reserving 10 slots: after its two steps it holds
    # 4 then 5 tokens of 10 reserved -> (4 + 5) / 20.
    r = simulate_reserved([(3, 2)], budget=10, reserve=lambda p, o: 10)
    assert r["effective"] == 9 / 20 and r["steps"] == 2


def test_paged_page_size_one_wastes_nothing_and_beats_max_reservation():
    lengths = sample_lengths("alpaca", 40, seed=3, max_len=256)
    assert simulate_paged(lengths, budget=2048, page_size=1)["effective"] == 1.0
    paged16 = simulate_paged(lengths, budget=2048, page_size=16)
    contiguous = simulate_reserved(lengths, budget=2048, reserve=lambda p, o: 256)
    assert contiguous["effective"] < paged16["effective"] < 1.0
    assert paged16["concurrency"] > contiguous["concurrency"]


def test_workload_means_follow_the_documented_figures():
    for name, w in WORKLOADS.items():
        lengths = sample_lengths(name, 20000, seed=0, max_len=100000)
        mp = sum(p for p, _ in lengths) / len(lengths)
        mo = sum(o for _, o in lengths) / len(lengths)
        assert abs(mp / w.prompt_mean - 1) < 0.05 and abs(mo / w.output_mean - 1) < 0.05


def test_kernel_tuning_sweep_refuses_to_run_without_a_gpu():
    import jax
    import pytest

    from benchmarks import bench_kernels

    if jax.default_backend() == "gpu":
        pytest.skip("on a GPU --tune runs (and takes minutes)")
    with pytest.raises(SystemExit) as err:
        bench_kernels.main(["--tune"])
    assert err.value.code == 2


@pytest.mark.slow  # 10-12 s; .ci/run runs it (the default suite's 8-minute budget)
def test_kernel_benchmark_times_prefill_on_cpu(tmp_path, monkeypatch):
    # On CPU the prefill table times the CPU ragged kernel (where it builds) and XLA, on
    # PREFILL_CASES_CPU (here one tiny case; timings meaningless).
    import json

    import jax

    from benchmarks import bench_kernels
    from benchmarks.common import OUT_ENV
    from paged_jax.kernels import cpu

    if jax.default_backend() != "cpu":
        pytest.skip("the CPU prefill table")
    monkeypatch.setenv(OUT_ENV, str(tmp_path))
    monkeypatch.setattr(bench_kernels, "PREFILL_CASES_CPU", [(2, 16, 48)])
    assert bench_kernels.main("--batches 1 --contexts 16 --repeats 1".split()) == 0
    out = json.loads((tmp_path / "kernels_cpu.json").read_text())
    names = [r["kernel"] for r in out["prefill"]]
    assert names == (["cpu ragged", "xla"] if cpu.available() else ["xla"])
    assert all(r["tflops"] > 0 and "error" not in r for r in out["prefill"])
    assert out["parameters"]["prefill_cases"] == [[2, 16, 48]]


# A decoder shape small enough for the GPU benchmarks to run end to end on CPU.
TINY_SHAPE = dict(
    vocab_size=300,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    rope_theta=10000.0,
    max_position_embeddings=256,
)


def test_engine_benchmark_runs_a_tiny_shape_and_writes_where_told(tmp_path, monkeypatch):
    # The GPU engine benchmark end to end on CPU with a tiny shape (timings meaningless):
    # every request generates exactly output_len tokens, the step split is filled in, and
    # --out's directory (not benchmarks/results) receives the file.
    import json

    from benchmarks import bench_engine
    from benchmarks.common import OUT_ENV

    monkeypatch.setitem(
        bench_engine.SHAPE_FIELDS,
        "tiny-test",
        TINY_SHAPE,
    )
    monkeypatch.setenv(OUT_ENV, str(tmp_path))
    argv = [
        "--models",
        "tiny-test",
        "--concurrency",
        "3",
        "--prompt-len",
        "5",
        "--output-len",
        "4",
        "--repeats",
        "1",
        "--backends",
        "xla",
        "--decode-kernel",
        "both",
        "--async-scheduling",
        "both",
        "--prefill-tokens",
        "10",
    ]
    assert bench_engine.main(argv) == 0
    out = json.loads((tmp_path / "engine_cpu.json").read_text())
    on, on_sync, off, off_sync = out["results"]
    assert on["system"] == "paged-jax (xla)" and on["concurrency"] == 3
    assert off["system"] == "paged-jax (xla, ragged kernel for decode steps)"
    assert on_sync["system"] == "paged-jax (xla, steps one at a time)"
    assert on["steps"] == off["steps"] == 4  # one prefill step (all prompts), 3 decode steps
    # overlapped: each step after the first dispatched while the one before ran
    assert on["overlapped_steps"] == 3 and on_sync["overlapped_steps"] == 0
    for r in (on, on_sync):  # the device's share is the dispatches and the waits
        split = r["dispatch_ms_per_step"] + r["wait_ms_per_step"]
        assert abs(split - r["device_ms_per_step"]) < 1e-6 * max(split, 1)
        assert r["decode_wall_ms_per_step"] > 0 and len(r["first_calls_ms"]) == 3
        assert r["phase_ms_per_step"]["launch"] > r["dispatch_ms_per_step"]
    assert on_sync["phase_ms_per_step"]["merge"] == 0  # no placeholders to merge
    # prefill steps: the concurrency's (3 prompts) and --prefill-tokens 10's (2 prompts),
    # for each overlapped engine (the two decode-kernel ways)
    assert len(out["prefill_step"]) == 4
    two, three = out["prefill_step"][:2]
    assert (two["sequences"], two["tokens"], three["tokens"]) == (2, 10, 15)
    assert three["ms"] > 0 and three["tflops"] > 0 and three["of_peak"] is None
    split_on, split_off = out["decode_step_split"]  # (the overlapped runs' engines)
    assert split_on["decode_only"] is True and split_off["decode_only"] is False
    assert split_on["step_ms"] > 0 and split_on["attention_ms"] > 0
    assert split_on["attention_ragged_kernel_ms"] > 0
    assert on["first_run_compilations"] >= 2 and on["compile_s_in_timed_runs"] == 0
    assert on["roofline_tokens_per_s"] is None  # no peaks known for a CPU
    assert out["parameters"]["max_num_batched_tokens"] == 15
    # The switch is undone afterwards.
    from paged_jax.batch import ScheduledSeq, build_batch
    from paged_jax.block_manager import BlockManager
    from paged_jax.metadata import AttentionMetadata

    bm = BlockManager(8, 4, watermark=0.0)
    bm.allocate("a", [1, 2, 3])
    assert AttentionMetadata.from_batch(build_batch(bm, [ScheduledSeq("a", 2, 3)])).decode_only


@pytest.mark.slow  # 8-11 s: four engines; .ci/run runs it
def test_engine_benchmark_runs_quantized_weights_and_lora_adapters_side_by_side(
    tmp_path, monkeypatch
):
    # --quantization and --lora-adapters (tiny shape on CPU, timings meaningless): a row
    # per format and adapter count, each labelled, every request its full output.
    import json

    from benchmarks import bench_engine
    from benchmarks.common import OUT_ENV

    monkeypatch.setitem(bench_engine.SHAPE_FIELDS, "tiny-test", TINY_SHAPE)
    monkeypatch.setenv(OUT_ENV, str(tmp_path))
    argv = "--models tiny-test --concurrency 3 --prompt-len 5 --output-len 4 --repeats 1 "
    argv += "--backends xla --no-split --quantization none int8 --lora-adapters 2 0"
    assert bench_engine.main(argv.split()) == 0
    out = json.loads((tmp_path / "engine_cpu.json").read_text())
    rows = out["results"]
    assert [(r.get("quantization"), r.get("lora_adapters")) for r in rows] == [
        (None, 0),
        (None, 2),
        ("int8", 0),
        ("int8", 2),
    ], rows
    assert rows[3]["system"] == "paged-jax (xla, int8 weights, 2 LoRA adapters)"
    assert all(r["steps"] == 4 and r["tokens_per_s"]["median"] > 0 for r in rows)
    assert out["parameters"]["lora_adapters"] == [2, 0]
    with pytest.raises(SystemExit):
        bench_engine.main(["--models", "tiny-test", "--lora-adapters", "-1"])


@pytest.mark.slow  # 6-8 s: two engines; .ci/run runs it
def test_engine_benchmark_runs_a_mixture_each_way_its_experts_multiply(tmp_path, monkeypatch):
    # --expert-way (a tiny mixture on CPU, timings meaningless): a row per way, labelled,
    # every request its full output; the platform's way restored afterwards
    import json

    from benchmarks import bench_engine
    from benchmarks.common import OUT_ENV
    from paged_jax.models.layers import moe

    shape = dict(TINY_SHAPE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    monkeypatch.setitem(bench_engine.SHAPE_FIELDS, "tiny-moe", shape)
    monkeypatch.setenv(OUT_ENV, str(tmp_path))
    before = dict(moe.EXPERT_WAYS)
    argv = "--models tiny-moe --concurrency 2 --prompt-len 5 --output-len 4 --repeats 1 "
    argv += "--backends xla --no-split --expert-way dense gather"
    assert bench_engine.main(argv.split()) == 0
    assert moe.EXPERT_WAYS == before
    rows = json.loads((tmp_path / "engine_cpu.json").read_text())["results"]
    assert [r["system"] for r in rows] == [
        "paged-jax (xla, experts dense)",
        "paged-jax (xla, experts gather)",
    ], rows
    assert all(r["steps"] == 4 and r["tokens_per_s"]["median"] > 0 for r in rows)


def test_engine_benchmark_kernel_ways_reach_the_next_trace(monkeypatch):
    # --decode-prefetch on/off: the decode kernel reads tuning.DECODE_PREFETCH at each call
    # (outside its jit), and the engine's cached step functions are dropped on the way in
    # and out, so each way's engine traces its own step.
    import jax.numpy as jnp

    from benchmarks.engine_switches import decode_prefetch
    from paged_jax.engine import runner
    from paged_jax.kernels.gpu import decode, tuning

    seen = []
    monkeypatch.setattr(decode, "_decode", lambda *a, **kw: seen.append(kw["prefetch"]))
    q, kv = jnp.zeros((1, 4, 16)), jnp.zeros((3, 8, 4, 16))
    args = (q, kv, jnp.ones(1, jnp.int32), jnp.ones((1, 2), jnp.int32))
    cleared = []
    monkeypatch.setattr(runner._make_run, "cache_clear", lambda: cleared.append(1))
    default = tuning.DECODE_PREFETCH
    for way, expected in (("on", True), ("off", False)):
        with decode_prefetch(way):
            decode.decode_paged_attention(*args, interpret=True)
        assert seen[-1] is expected and tuning.DECODE_PREFETCH == default
    assert len(cleared) == 3, cleared  # in for each way, out for the one that changed it
    with decode_prefetch("default"):
        decode.decode_paged_attention(*args, interpret=True)
    assert seen[-1] is default
    # --w8a16-kernel on/off: the model's platforms for the few-row product, restored after
    from benchmarks.engine_switches import w8a16_kernel
    from paged_jax.models.layers import KERNELS

    for way, inside in (("on", ("gpu",)), ("off", ()), ("default", ())):
        with w8a16_kernel(way):
            assert KERNELS["w8a16"].platforms == inside
        assert KERNELS["w8a16"].platforms == ()


def test_roofline_of_the_engine_workload():
    from benchmarks.engine_roofline import (
        SHAPE_FIELDS,
        device_peaks,
        prefill_flops,
        roofline_tokens_per_s,
    )

    # Hand-worked: one layer, E=F=D=8, one head, V=16, 2 sequences of 4 prompt tokens,
    # 3 outputs, infinitely fast FLOPs: only the 2 decode steps' bytes count.
    f = dict(
        vocab_size=16, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=1,
        num_kv_heads=1, head_dim=8,
    )  # fmt: skip
    # layer products 2*8*8 + 2*8*8 + 3*8*8 = 448, norms 2*8 + 8, two tables 2*16*8 = 256
    weights = 2 * (448 + 24 + 256)  # bf16 bytes
    kv = 2 * 1 * 2 * 1 * 8  # bf16 bytes a token: one layer, K and V, one head of 8
    seconds = sum((weights + 2 * (4 + k) * kv) / 100.0 for k in (1, 2))
    got = roofline_tokens_per_s(f, 2, 4, 3, (float("inf"), 100.0))
    assert abs(got - 2 * 3 / seconds) < 1e-9 * got
    # its prefill: 2 x (every token's layer products 2 * 448 * 4, the head for the last
    # token 2 * 16 * 8, attention 4 * 8 FLOPs a (query, key) pair over 4 * 5 / 2 pairs)
    assert prefill_flops(f, 2, 4) == 2 * (2 * 448 * 4 + 2 * 16 * 8 + 4 * 8 * 10)
    # Llama-3-8B on an H100 at 256 x 128/128: issue 57's table put the ideal at 23,552
    # tokens/s counting every prompt token's head FLOPs; this ideal counts the last only
    h100 = device_peaks("NVIDIA H100 80GB HBM3")
    ideal = roofline_tokens_per_s(SHAPE_FIELDS["llama3-8b"], 256, 128, 128, h100)
    assert 23_552 < ideal < 1.07 * 23_552, ideal
    assert device_peaks("cpu") is None
    # A mixture: 4 experts of width 8, 2 a token, a router of 8 x 4. A token multiplies by
    # its router and 2 experts (32 + 2 * 3 * 8 * 8 = 416 parameters); 2 tokens choose
    # 4 * (1 - (1 - 2/4) ** 2) = 3 experts on average: 32 + 3 * 192 = 608 read
    from benchmarks.engine_roofline import _feed_forward

    m = dict(f, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8)
    assert _feed_forward(m, 2) == (416, 608) and _feed_forward(f, 2) == (192, 192)
    assert prefill_flops(m, 2, 4) == 2 * (2 * (256 + 416) * 4 + 2 * 16 * 8 + 4 * 8 * 10)


def test_every_benchmark_module_is_named_by_both_commands(capsys):
    # python -m benchmarks and paged-jax bench take one list: every bench_<name>.py
    import pathlib

    from benchmarks.__main__ import NAMES
    from paged_jax import cli

    here = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
    modules = {p.stem.removeprefix("bench_") for p in here.glob("bench_*.py")}
    assert set(NAMES) == modules and len(NAMES) == len(modules)
    parser = cli._parser()
    for name in ("engine", "draw", "step_kernels"):  # (paged-jax bench used to refuse these)
        assert parser.parse_args(["bench", name, "--out", "x"]).name == name
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "nope"])
    assert "invalid choice: 'nope'" in capsys.readouterr().err


def test_benchmarks_main_takes_out_before_the_benchmark_args(tmp_path):
    import subprocess
    import sys

    p = subprocess.run(
        [sys.executable, "-m", "benchmarks", "block_manager", "--out", str(tmp_path), "--help"],
        capture_output=True,
        text=True,
    )
    assert p.returncode == 0, p.stderr
    bad = subprocess.run(
        [sys.executable, "-m", "benchmarks", "kernels", "--out"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "--out: expected a directory" in bad.stderr


def test_layer_view_benchmark_agrees_across_ways_and_writes_where_told(tmp_path, monkeypatch):
    # Tiny shape on CPU (timings meaningless): the three ways of passing a layer give the
    # same attention, and the result file lands in --out's directory.
    import json

    from benchmarks import bench_layer_view
    from benchmarks.common import OUT_ENV

    monkeypatch.setenv(OUT_ENV, str(tmp_path))
    argv = "--layers 3 --pages 64 --batch 4 --context 40 --repeats 2 --heads 4 2 16".split()
    assert bench_layer_view.main(argv) == 0
    out = json.loads((tmp_path / "layer_view_cpu.json").read_text())
    assert [r["way"] for r in out["results"]] == ["slice", "view", "separate arrays"]
    assert all(r["max_abs_diff_vs_arrays"] == 0.0 and r["ms"] > 0 for r in out["results"])
    with pytest.raises(SystemExit):
        bench_layer_view.main("--pages 8 --batch 4 --context 40".split())


def test_results_go_to_a_new_directory_here_unless_told(tmp_path, monkeypatch):
    from benchmarks import common

    monkeypatch.delenv(common.OUT_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(common, "_DEFAULT_DIR", None)
    path = common.write_result("x", {"rate": float("nan"), "rows": [1.5, float("inf")]})
    assert path.parent.parent == tmp_path / "bench-results"
    assert common.RESULTS not in path.parents  # never the committed files by default
    import json

    assert json.loads(path.read_text(), parse_constant=pytest.fail) == {
        "rate": None,
        "rows": [1.5, None],
    }
    assert common.take_out_arg(["--repeats", "3", "--out=somewhere"]) == ["--repeats", "3"]
    assert common.results_dir() == Path("somewhere")
    for bad in (["--out"], ["--out", "--repeats"], ["--out", str(path)]):
        with pytest.raises(ValueError, match="--out: expected a directory"):
            common.take_out_arg(bad)


@pytest.mark.parametrize(
    "name,argv,message",
    [
        ("throughput", ["--requests", "0"], "--requests: expected an int >= 1, got 0"),
        ("memory", ["--budget", "100"], "--budget: expected >= 2048"),
        ("sharing", ["--requests", "x"], "--requests: expected an int >= 1, got 'x'"),
        ("block_manager", ["--repeats", "-1"], "--repeats: expected an int >= 1, got -1"),
    ],
)
def test_bad_benchmark_arguments_exit_2_before_running(name, argv, message, capsys):
    import importlib

    mod = importlib.import_module(f"benchmarks.bench_{name}")
    with pytest.raises(SystemExit) as e:
        mod.main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_peers_workload_and_summary(monkeypatch):
    from benchmarks import bench_peers

    a, b = bench_peers.workload(5), bench_peers.workload(5)
    assert a == b and all(90 <= len(p) <= 110 for p in a)  # seeded, as documented
    assert all(100 <= t < 40000 for p in a for t in p)
    monkeypatch.delenv("VLLM_PYTHON", raising=False)
    python, why = bench_peers._python_for("vllm", None)
    assert python is None and "--vllm-python" in why  # skipped, and says how to run it
    res = dict(
        engine="x",
        run_s=[2.0, 4.0, 1.0],
        ttft_s=[0.1, 0.3, 0.2],
        startup_s=1.0,
        first_run_s=5.0,
        peak_rss_bytes=2**30,
        versions={},
        tokens=[[1, 2], [3, 4], [5, 6]],
    )
    row = bench_peers.summarize(res, 8, [[1, 2], [3, 5], [5, 6]])
    assert row["tokens_per_s"] == dict(min=2.0, median=4.0, max=8.0)
    assert row["ttft_s"]["median"] == 0.2 and row["peak_rss_gib"] == 1.0
    assert row["greedy_tokens_equal"] == "2/3 prompts"


def test_serve_arrivals_workload_and_summaries():
    import math

    from benchmarks import bench_serve

    times = bench_serve.arrivals(4.0, 4000, seed=3)
    assert times == bench_serve.arrivals(4.0, 4000, seed=3) and times[0] == 0.0
    assert all(b >= a for a, b in zip(times, times[1:], strict=False))
    assert abs(times[-1] / (len(times) - 1) - 0.25) < 0.02  # mean gap 1 / rate
    assert bench_serve.arrivals(math.inf, 3) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="rate: expected > 0, got 0"):
        bench_serve.arrivals(0, 3)
    tiny, smol = bench_serve.workload("tiny-llama", 6), bench_serve.workload("smollm2", 6)
    assert all(90 <= len(p) <= 110 for p in tiny + smol)
    assert all(0 <= t < 256 for p in tiny for t in p)  # bytes for the byte vocabulary
    assert all(100 <= t < 40000 for p in smol for t in p)
    assert bench_serve.workload("smollm2", 6, seed=1) != smol  # every run its own prompts

    def rec(sent, chunks, tokens, error=None):
        return dict(
            sent=sent,
            chunks=chunks,
            end=chunks[-1] + 0.5 if chunks else None,
            tokens=tokens,
            error=error,
        )

    records = [
        rec(0.0, [1.0, 1.5, 2.0], 3),  # TTFT 1.0, TPOT 0.5, gaps 0.5 0.5
        rec(1.0, [1.5, 1.7, 1.9, 2.1, 2.3], 5),  # TTFT 0.5, TPOT 0.2, gaps 0.2 x4
        rec(2.0, [], 0, error="HTTP 429: full"),
    ]
    run = bench_serve.summarize_run(records)
    assert run["errors"] == 1 and run["first_error"] == "HTTP 429: full"
    assert run["duration_s"] == 2.8 and run["completion_tokens"] == 8
    assert run["throughput_tok_s"] == pytest.approx(8 / 2.8)
    assert run["ttft_s"] == pytest.approx(0.75) and run["tpot_s"] == pytest.approx(0.35)
    assert run["itl_s"] == pytest.approx(0.2) and run["itl_p90_s"] == pytest.approx(0.5)
    assert run["e2e_s"] == pytest.approx((2.5 + 1.8) / 2)
    runs = [dict(run, ttft_s=t) for t in (0.3, 0.1, 0.2)] + [dict(run, ttft_s=None)]
    rate = bench_serve.summarize_rate(runs)
    assert rate["ttft_s"] == dict(min=0.1, median=0.2, max=0.3)  # a run without any: left out
    assert rate["errors"] == 4 and rate["tpot_s"]["median"] == pytest.approx(0.35)


@pytest.mark.slow
def test_serve_benchmark_measures_a_real_server(tmp_path, monkeypatch):
    """The whole benchmark against a real ``paged-jax serve`` on tiny-llama: every request
    answered, tokens counted from the stream, results and plot where told."""
    import json

    from benchmarks import bench_serve, common

    monkeypatch.setenv(common.OUT_ENV, str(tmp_path))
    argv = ["--models", "tiny-llama", "--engines", "paged-jax", "vllm", "--rates", "8", "inf"]
    argv += ["--requests", "4", "--output-len", "6", "--repeats", "1"]
    assert bench_serve.main(argv) == 0
    data = json.loads((tmp_path / "serve.json").read_text())
    (res,) = data["results"]
    assert res["engine"] == "paged-jax" and res["versions"]["jax"]
    assert [r["rate"] for r in res["rows"]] == [8.0, "inf"]
    for row in res["rows"]:
        assert row["errors"] == 0 and row["throughput_tok_s"]["median"] > 0
        assert 0 < row["ttft_s"]["min"] <= row["e2e_s"]["min"]
        assert row["compiles_measured"] >= 0
    assert "tiny-llama exists only in paged-jax" in data["skipped"]["vllm / tiny-llama"]


def test_hybrid_memory_counted_by_hand():
    """Gemma 3 1B's pattern at 4096 + 16 tokens, pages of 16: 257 pages a layer. The 4
    global layers keep all of them; each of the 6 sliding groups of 4 layers keeps the
    pages of keys 3601..4112 (the next token's window of 512): pages 225..256, 32."""
    from benchmarks.bench_hybrid import MODELS, measure

    windows, kv_heads, head_dim = MODELS["gemma-3-1b"]
    r = measure(windows, kv_heads, head_dim, context=4096, page=16, chunk=512)
    slot = 16 * 2 * kv_heads * head_dim * 2  # one layer slot of one page, bf16
    assert (r["groups"], r["slots_per_page"]) == (7, 4)
    assert r["whole_model_pages"] == 26 * 257 * slot
    assert r["hybrid_decoding"] == (4 * 257 + 6 * 4 * 32) * slot
    # at admission every group holds the 4096-token prompt: 7 groups x 256 pages x 4
    assert r["hybrid_admission"] == 7 * 256 * 4 * slot


def test_host_overhead_benchmark_runs_every_mode_and_writes_where_told(tmp_path, monkeypatch):
    # Three modes on tiny-llama (timings meaningless): the same tokens in each (asserted
    # inside), shares in [0, 1], a multi-step launch counted as its K device steps.
    import json

    from benchmarks import bench_host_overhead
    from benchmarks.common import OUT_ENV

    monkeypatch.setenv(OUT_ENV, str(tmp_path))
    argv = ["--seqs", "8", "--steps", "9", "--repeats", "1", "--scheduler-steps", "4"]
    assert bench_host_overhead.main(argv) == 0
    data = json.loads((tmp_path / "host_overhead.json").read_text())
    assert data["parameters"]["scheduler_steps"] == 4
    (row,) = data["results"]
    for key in (
        "plain_host_share",
        "overlapped_host_share",
        "multi_host_share",
        "plain_decode_host_share",
        "multi_decode_host_share",
        "multi_overlapped_host_share",
        "multi_overlapped_decode_host_share",
        "multi_steady_host_share",
        "multi_overlapped_decode_cpu_share",
    ):
        assert 0.0 <= row[key]["median"] <= 1.0, key
    # overlapped, the launch that finishes nothing completes in the call that finishes
    # every request: no steady step, no share
    assert row["steady_steps_multi_overlapped"] == 0
    assert row["multi_overlapped_steady_host_share"]["median"] is None
    assert row["multi_overlapped_steady_cpu_share"]["median"] is None
    # 1 prompt step + 8 decode steps in each (two launches of 4 in the multi-step runs)
    assert row["steps_multi"] == row["steps_plain"] == row["steps_multi_overlapped"] == 9
    # the first launch finishes nothing: steady; the second finishes every request
    assert row["steady_steps_multi"] == 4
    # the decode phase is the launches in both: overlapped, the prompts' step completes in
    # the first call with every request admitted, and is left out
    assert row["decode_steps_multi"] == row["decode_steps_multi_overlapped"] == 8


def test_host_overhead_records_another_model_beside_tiny_llama():
    from benchmarks.bench_host_overhead import result_name

    assert result_name("tiny-llama") == "host_overhead"
    assert result_name("smollm2-135m-instruct") == "host_overhead_smollm2-135m-instruct"


@pytest.mark.slow  # 9 s; .ci/run runs it (the default suite's 8-minute budget)
def test_sampler_benchmark_times_every_setting_and_writes_where_told(tmp_path, monkeypatch):
    # tiny-llama, a few tokens (timings meaningless): every setting has engine steps and
    # sampler times on the model's own logits, greedy's step ratio to itself is 1.
    import json

    from benchmarks import bench_sampler
    from benchmarks.common import OUT_ENV

    monkeypatch.setenv(OUT_ENV, str(tmp_path))
    argv = ["--model", "tiny-llama", "--seqs", "3", "--steps", "5", "--repeats", "1"]
    assert bench_sampler.main([*argv, "--batches", "2"]) == 0
    data = json.loads((tmp_path / "sampler_tiny-llama.json").read_text())
    assert data["logit_batches"] == 2 and data["vocab"] == 320  # tiny-llama's
    rows = {r["setting"]: r for r in data["results"]}
    assert set(rows) == set(bench_sampler.SETTINGS)
    assert rows["greedy"]["engine_step_over_greedy"] == [1.0]
    for r in rows.values():
        assert r["engine_ms_per_step"]["min"] > 0 and r["sampler_ms"] > 0
        assert r["sampler_xla_ms"] > 0 and r["sampler_share_of_greedy_step"] > 0


def test_speculative_verify_cost_runs_a_tiny_shape_and_writes_where_told(tmp_path, monkeypatch):
    # The GPU session's verify-cost measurement end to end on CPU (timings meaningless):
    # every k keeps the tokens of plain decoding and needs fewer steps.
    import json

    from benchmarks import bench_engine, bench_speculative
    from benchmarks.common import OUT_ENV

    monkeypatch.setitem(
        bench_engine.SHAPE_FIELDS,
        "tiny-test",
        TINY_SHAPE,
    )
    monkeypatch.setenv(OUT_ENV, str(tmp_path))
    argv = ["--verify-cost", "--shape", "tiny-test", "--concurrency", "2", "--ks", "2"]
    assert bench_speculative.main([*argv, "--repeats", "1", "--output-len", "12"]) == 0
    rows = json.loads((tmp_path / "speculative_verify_cost.json").read_text())["results"]
    assert [(r["concurrency"], r["k"]) for r in rows] == [(2, 0), (2, 2)]
    assert rows[0]["step_cost_vs_decode"] == 1.0 and rows[1]["ms_per_step"] > 0
    assert bench_speculative.main(["--verify-cost", "--shape", "nope"]) == 2


def test_dispatch_benchmark_drives_every_way_and_writes_where_told(tmp_path, monkeypatch):
    # The dispatch model on CPU at a tiny size (timings meaningless): every way of driving
    # the step reports its wall, dispatch and wait times, none failing.
    import json

    from benchmarks import bench_dispatch
    from benchmarks.common import OUT_ENV

    monkeypatch.setenv(OUT_ENV, str(tmp_path))
    argv = "--layers 2 --hidden 32 --ffn 64 --rows 8 --passes 1 --host-ms 0.5 --iters 4"
    assert bench_dispatch.main([*argv.split(), "--repeats", "1"]) == 0
    out = json.loads((tmp_path / "dispatch_cpu.json").read_text())
    assert [r["way"] for r in out["results"]] == list(bench_dispatch.WAYS)
    for r in out["results"]:
        assert "error" not in r, r
        assert r["dispatch_ms"]["median"] > 0 and r["wait_ms"]["median"] >= 0
        assert r["wall_ms"]["median"] >= 0.5  # the host's work is in every step's wall
    assert out["serial_ms"] == out["device_ms_per_step"] + 0.5


def test_products_benchmark_times_both_ways_over_the_same_bytes(tmp_path, monkeypatch):
    # Separate and fused projections hold the same weights: the bytes and FLOPs per
    # step agree, so the reported rates are in the ratio of the times.
    import json

    from benchmarks import bench_engine, bench_products
    from benchmarks.common import OUT_ENV

    monkeypatch.setitem(bench_engine.SHAPE_FIELDS, "tiny-test", TINY_SHAPE)
    monkeypatch.setenv(OUT_ENV, str(tmp_path))
    assert bench_products.main(["--shape", "tiny-test", "--rows", "4", "--repeats", "2"]) == 0
    out = json.loads((tmp_path / "products_cpu.json").read_text())
    sep, fused = out["results"]
    assert (sep["way"], fused["way"]) == ("separate", "fused")
    for a, b in (("weight_gb_per_s", "ms"), ("tflops", "ms")):
        assert abs(sep[a] * sep[b] - fused[a] * fused[b]) < 1e-6 * sep[a] * sep[b]


def test_products_benchmark_8_bit_ways_read_a_byte_a_weight_and_stay_near_the_floats(
    tmp_path, monkeypatch
):
    import json

    from benchmarks import bench_engine, bench_products
    from benchmarks.common import OUT_ENV

    monkeypatch.setitem(bench_engine.SHAPE_FIELDS, "tiny-test", TINY_SHAPE)
    monkeypatch.setenv(OUT_ENV, str(tmp_path))
    argv = "--shape tiny-test --rows 16 --repeats 2 --formats fp8 int8 --pallas 16:16:4:1"
    argv += " 16:16:4:1:p"  # and with the weight's chunks loaded ahead
    assert bench_products.main([*argv.split(), "--pallas-formats", "bf16", "int8"]) == 0
    rows = json.loads((tmp_path / "products_cpu.json").read_text())["results"]
    assert [r["way"] for r in rows] == [
        "separate",
        "fused",
        "fused, fp8 W8A16",
        "fused, fp8 W8A8",
        "fused, fp8 W8A8, [out, in]",
        "fused, int8 W8A16",
        "fused, int8 W8A8",
        "fused, Pallas 16:16:4:1",  # the GPU's few-row product, interpreted
        "fused, int8 W8A16, Pallas 16:16:4:1",
        "fused, Pallas 16:16:4:1:p",
        "fused, int8 W8A16, Pallas 16:16:4:1:p",
    ]
    assert rows[7]["relative_error"] < 1e-5  # f32 on CPU: the same product
    for plain, ahead in ((rows[7], rows[9]), (rows[8], rows[10])):  # the same sums
        assert ahead["relative_error"] == plain["relative_error"]
    assert rows[5]["weight_gb_per_s"] * rows[5]["ms"] == pytest.approx(
        rows[8]["weight_gb_per_s"] * rows[8]["ms"]
    )
    fused = rows[1]
    f32_bytes = fused["weight_gb_per_s"] * fused["ms"]
    for r in rows[2:7] + rows[8:9] + rows[10:]:
        # the same FLOPs; a byte a weight plus an f32 scale per output channel
        assert abs(r["tflops"] * r["ms"] - fused["tflops"] * fused["ms"]) < 1e-6 * r["ms"]
        assert f32_bytes / 4 < r["weight_gb_per_s"] * r["ms"] < f32_bytes / 4 * 1.2
        assert 0 < r["relative_error"] < (0.1 if "fp8" in r["way"] else 0.03)


def test_lora_benchmark_products_agree_and_write_where_told(tmp_path, monkeypatch):
    # The two ways of applying each token's adapter give the same sums (checked inside,
    # every case), and the file records each case's times.
    import json

    from benchmarks import bench_lora
    from benchmarks.common import OUT_ENV

    monkeypatch.setenv(OUT_ENV, str(tmp_path))
    assert bench_lora.main(["--no-engine", "--rank", "4"]) == 0
    out = json.loads((tmp_path / "lora_cpu.json").read_text())
    assert [(r["tokens"], r["slots"]) for r in out["products"]] == [
        (32, 4), (32, 16), (256, 4), (256, 16)
    ]  # fmt: skip
    assert all(r["masked_ms"] > 0 and r["ragged_ms"] > 0 for r in out["products"])
    assert out["engine"] == []


def test_structured_benchmark_schemas_requests_and_validation():
    # The ten schemas are valid JSON Schema, each closed as OpenAI's strict mode asks
    # (no other properties, every property required); requests cycle them over the
    # subjects with one seed each; and the check counts an output that breaks its schema
    # (or does not parse) as a named failure.
    import types

    import jsonschema

    from benchmarks import bench_structured as bs

    assert len(bs.SCHEMAS) == 10

    def objects(schema):
        if isinstance(schema, dict):
            if schema.get("type") == "object":
                yield schema
            for v in schema.values():
                yield from objects(v)
        elif isinstance(schema, list):
            for v in schema:
                yield from objects(v)

    for name, schema in bs.SCHEMAS.items():
        jsonschema.Draft202012Validator.check_schema(schema)
        for obj in objects(schema):
            assert obj["additionalProperties"] is False, name
            assert set(obj["required"]) == set(obj["properties"]), name
    reqs = bs.requests(23)
    assert [r[0] for r in reqs[:11]] == list(bs.SCHEMAS) + ["person"]
    assert [r[2] for r in reqs] == list(range(23))
    assert bs.SUBJECTS[1] in reqs[10][1][0]["content"] and "schema" in reqs[10][1][0]["content"]

    def out(text):
        c = types.SimpleNamespace(text=text, finish_reason="stop")
        return types.SimpleNamespace(outputs=[c])

    good = '{"city": "Oslo", "celsius": -3.5, "humidity": 80, "sky": "snow"}'
    cold = '{"city": "Oslo", "celsius": -99, "humidity": 80, "sky": "snow"}'
    got = bs.check([out(good), out(cold), out(good[:-1])], ["weather"] * 3)
    assert got["valid"] == 1 and got["total"] == 3
    assert [f["schema"] for f in got["failures"]] == ["weather", "weather"]
    assert "-99" in got["failures"][0]["error"]


def test_throughput_benchmark_times_both_schemes_in_rounds(tmp_path, monkeypatch):
    # Static batching and the paged engine alternate in each timed round; the file holds
    # each scheme's rounds and min / median / max, the ratio of the medians, each
    # round's ratio, and how many requests got the same greedy tokens from both.
    import json

    from benchmarks import bench_throughput
    from benchmarks.common import OUT_ENV

    monkeypatch.setenv(OUT_ENV, str(tmp_path))
    assert bench_throughput.main(["--requests", "4", "--budget", "1024", "--repeats", "2"]) == 0
    out = json.loads((tmp_path / "throughput.json").read_text())
    assert out["parameters"]["repeats"] == 2 and out["identical_outputs"] == 4
    static, paged, sync = out["results"]
    assert sync["scheme"] == "paged, one step at a time"
    for row in (static, paged, sync):
        assert len(row["rounds_s"]) == 2 and all(t > 0 for t in row["rounds_s"])
        s = row["seconds"]
        assert s["min"] <= s["median"] <= s["max"] == max(row["rounds_s"])
    assert out["ratio"] == pytest.approx(static["seconds"]["median"] / paged["seconds"]["median"])
    want = static["seconds"]["median"] / sync["seconds"]["median"]
    assert out["ratio_one_step_at_a_time"] == pytest.approx(want)
    assert out["round_ratios"] == pytest.approx(
        [a / b for a, b in zip(static["rounds_s"], paged["rounds_s"], strict=True)]
    )


def test_lm_eval_benchmark_writes_its_tasks_and_compares_two_runs(tmp_path, monkeypatch, capsys):
    """The harness's side (lm_eval, torch) is not installed here: its task files, and
    the comparison of two runs' sample files in the layout lm_eval 0.4 writes."""
    from benchmarks import bench_lm_eval as b

    d = b.write_tasks(tmp_path)
    docs = [json.loads(line) for line in open(d / "pj_mc.jsonl")]
    assert len(docs) == len(b.QUESTIONS) == 30
    assert all(0 <= q["answer"] < len(q["choices"]) == 4 for q in docs)
    assert f"test: {d.resolve()}/pj_ppl.jsonl" in (d / "pj_ppl.yaml").read_text()
    assert 'doc_to_choice: "{{choices}}"' in (d / "pj_mc.yaml").read_text()

    def run(name, mc, rolling, acc):
        where = tmp_path / name / "model"
        where.mkdir(parents=True)
        results = {
            "pj_mc": {"acc,none": acc},
            "pj_ppl": {"word_perplexity,none": 19.0, "bits_per_byte,none": 0.76},
        }
        (where / "results_1.json").write_text(json.dumps({"results": results}))
        with open(where / "samples_pj_mc_1.jsonl", "w") as f:
            for i, choices in enumerate(mc):
                resps = [[[str(ll), str(g)]] for ll, g in choices]
                f.write(json.dumps({"doc_id": i, "resps": resps}) + "\n")
        with open(where / "samples_pj_ppl_1.jsonl", "w") as f:
            f.write(json.dumps({"doc_id": 0, "resps": [[str(rolling)]]}) + "\n")
        return b.read_run(tmp_path / name)

    ours = run("a", [[(-0.25, True), (-6.0, False)], [(-1.0, False), (-0.5, True)]], -2054.65, 1.0)
    theirs = run("b", [[(-0.26, True), (-6.0, False)], [(-1.0, True), (-0.5, False)]], -2054.6, 0.5)
    assert ours[0]["pj_mc"]["acc"] == 1.0 and theirs[0]["pj_ppl"]["bits_per_byte"] == 0.76
    got = b.compare(ours[1], theirs[1])
    assert got["requests"] == 5 and got["greedy_flags"] == 4 and got["greedy_flags_equal"] == 2
    assert got["max_abs_loglikelihood_diff"] == pytest.approx(0.05)
    assert got["mean_abs_loglikelihood_diff"] == pytest.approx(0.06 / 5)
    fewer = dict(list(theirs[1].items())[:-1])
    with pytest.raises(ValueError, match="different requests"):
        b.compare(ours[1], fewer)
    monkeypatch.delenv("LM_EVAL_PYTHON", raising=False)
    with pytest.raises(SystemExit):
        b.main([])
    assert "--lm-eval-python" in capsys.readouterr().err


_HLO = """HloModule jit_step, entry_computation_layout={(bf16[64,4096]{1,0})->bf16[64,4096]{1,0}}

%fused_add (p0: bf16[64,4096]) -> bf16[64,4096] {
  %p0 = bf16[64,4096]{1,0} parameter(0)
  ROOT %add.1 = bf16[64,4096]{1,0} add(%p0, %p0)
}

ENTRY %main.9 (x.1: bf16[64,4096]) -> bf16[64,4096] {
  %x.1 = bf16[64,4096]{1,0} parameter(0)
  %constant.3 = s32[] constant(7)
  %gemm_fusion_dot = f32[4,64,6144]{2,1,0} fusion(%x.1), kind=kCustom, calls=%g
  %custom-call.2 = (bf16[64,8,16,128]{3,2,1,0}, f32[64,8]{1,0}) custom-call(%x.1), \
custom_call_target="__gpu$xla.gpu.triton"
  %get-tuple-element.1 = bf16[64,8,16,128]{3,2,1,0} get-tuple-element(%custom-call.2), index=0
  %bitcast.5 = bf16[64,4096]{1,0} bitcast(%get-tuple-element.1)
  ROOT %loop_add_fusion = bf16[64,4096]{1,0} fusion(%bitcast.5), kind=kLoop, calls=%fused_add
}
"""


def test_step_kernels_counts_the_entry_s_launches_and_a_layer_s_share():
    from benchmarks.bench_step_kernels import kernels_of, per_layer

    assert kernels_of(_HLO) == [
        ("gemm_fusion_dot", "fusion:kCustom", "f32[4,64,6144]{2,1,0}"),
        (
            "custom-call.2",
            "custom-call:__gpu$xla.gpu.triton",
            "(bf16[64,8,16,128]{3,2,1,0}, f32[64,8]{1,0})",
        ),
        ("loop_add_fusion", "fusion:kLoop", "bf16[64,4096]{1,0}"),
    ]  # the fused computation's own ops, parameters, constants, tuples and bitcasts: none
    two = [("n", "fusion:kLoop", "")] * 3 + [("g", "fusion:kCustom", "")] * 4
    four = two + [("g", "fusion:kCustom", "")] * 4 + [("n", "fusion:kLoop", "")] * 2
    got = per_layer({2: two, 4: four}, (2, 4))
    assert got["kernels_per_layer"] == 3.0 and got["kernels_outside_layers"] == 1.0
    assert got["per_layer_by_kind"] == {"fusion:kCustom": 2.0, "fusion:kLoop": 1.0}


def test_step_kernels_says_what_it_needs_without_jax_s_cuda_plugin():
    import importlib.util
    import subprocess

    if importlib.util.find_spec("jax_plugins") and any(
        importlib.util.find_spec(f"jax_plugins.xla_cuda{v}") for v in (12, 13)
    ):
        pytest.skip("JAX's CUDA plugin is installed here: the count would run")
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run(
        [sys.executable, "-m", "benchmarks", "step_kernels", "--variants", "bf16"],
        cwd=root, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 2, r.stdout + r.stderr
    assert "jax[cuda12]==" in r.stdout and "cannot describe a CUDA device" in r.stdout


def test_the_moe_benchmark_compares_each_way_with_a_dense_model(tmp_path, monkeypatch):
    import json

    from benchmarks import bench_moe
    from benchmarks.common import OUT_ENV

    monkeypatch.setenv(OUT_ENV, str(tmp_path))
    small = dict(bench_moe.SHAPE, vocab_size=320, hidden_size=32, num_layers=2, head_dim=8)
    monkeypatch.setattr(bench_moe, "SHAPE", small)
    monkeypatch.setattr(bench_moe, "WIDTH", 16)
    argv = "--concurrency 2 --prompt-len 4 --output-len 3 --repeats 1 --ways packed dense"
    assert bench_moe.main(argv.split()) == 0
    rows = json.loads((tmp_path / "moe_cpu.json").read_text())["rows"]
    assert [r["engine"] for r in rows] == ["dense", "moe packed", "moe dense"]
    assert rows[0]["ratio_to_dense"] == 1.0 and all(r["tokens_per_s"]["min"] > 0 for r in rows)
    from paged_jax import linear

    assert rows[1]["experts_packed"] == linear.available() and not rows[2]["experts_packed"]


def test_the_gguf_benchmark_compares_the_loads_of_one_file(tmp_path, monkeypatch):
    import json

    from gguf import GGMLQuantizationType as Q
    from test_gguf import _model, write_gguf

    from benchmarks import bench_gguf
    from benchmarks.common import OUT_ENV

    monkeypatch.setenv(OUT_ENV, str(tmp_path / "out"))
    path = tmp_path / "m.gguf"
    write_gguf(path, _model(), qtype=Q.Q4_1)
    argv = [str(path), "--prompts", "2", "--tokens", "3", "--repeats", "1"]
    assert bench_gguf.main(argv) == 0
    (result,) = json.loads((tmp_path / "out" / "gguf.json").read_text())["results"]
    loads = result["loads"]
    assert list(loads) == ["kept", "dequantized", "int4"]
    assert result["formats"]["Q4_1"] > 0
    assert loads["kept"]["bytes"] < 0.3 * loads["dequantized"]["bytes"]
    assert loads["kept"]["same_sequences"] == loads["dequantized"]["same_sequences"] == 2
    assert all(v["tokens_per_s"]["min"] > 0 for v in loads.values())


def test_the_grammar_step_benchmark_fills_a_step_s_rows_both_ways(tmp_path):
    from test_gguf import _model, write_gguf

    from benchmarks import bench_grammar
    from paged_jax.models import load_gguf

    write_gguf(tmp_path / "m.gguf", _model(vocab_size=300))
    _, tok = load_gguf(tmp_path / "m.gguf")
    r = bench_grammar.step_fill(tok, rows=6, steps=2, repeats=1)  # raises if the masks differ
    assert r["rows"] == 6 and r["row_by_row_ms"]["min"] > 0 and r["together_ms"]["min"] > 0

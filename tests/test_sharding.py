"""Tensor and data parallelism on 8 fake CPU devices, and over 2 processes x 4 devices
(tests/tp_worker.py: the model's paged step; tests/mesh_worker.py: the engine). The
workers run in their own processes: the device count is fixed when JAX starts."""

import json
import pathlib
import socket
import subprocess
import sys

import numpy as np
import pytest

from paged_jax import linear

HERE = pathlib.Path(__file__).resolve().parent


def _run(argv: list[str], timeout: int = 600, **kw) -> dict:
    """The JSON object a Python process prints last (``argv`` after the interpreter)."""
    done = subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, timeout=timeout, **kw
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _worker(script: str, *args: str, timeout: int = 600) -> dict:
    return _run([str(HERE / script), *args], timeout)


def _check_steps(out: dict) -> None:
    for name, r in out.items():
        if "error" in r:
            continue
        # prefill and 4 decode steps: logits as on one device, the same greedy tokens
        assert r["max_logit_error"] < 1e-4 and r["same_tokens"], (name, r)
        tp = int(name.rpartition("/tp")[2])
        assert r["device_cache_bytes"] * tp == r["total_cache_bytes"], (name, r)
        assert r["cache_collectives"] == 0, (name, r)  # the pool never moves
        assert r["all_reduces"] > 0, (name, r)  # the partial sums after o and down do


def test_a_mixture_of_experts_on_a_tensor_parallel_mesh_equals_one_device():
    """Each expert's width split over 2 and 4 devices (and the shared expert's), the
    router replicated: the logits and greedy tokens of one device, the pool never moved;
    GPT-OSS's sinks split with their heads, its experts' biases with their columns. With
    expert_parallel, whole experts on each device instead (2 or 1 of the 4), each
    token's sum added up over the devices: the same logits and tokens; int8 and int4
    experts (their scales split along) against one device's quantized model."""
    mixtures = ("moe-4:2,4", "gpt-oss-4:2", "moe-4-ep:4", "gpt-oss-4-ep@ragged:2")
    out = _worker("tp_worker.py", "xla", *mixtures, "moe-4-ep#int8:2", "moe-4#int4:2")
    assert set(out) == {
        "moe-4/tp2", "moe-4/tp4", "gpt-oss-4/tp2", "moe-4-ep/tp4", "gpt-oss-4-ep@ragged/tp2",
        "moe-4-ep#int8/tp2", "moe-4#int4/tp2",
    }  # fmt: skip
    assert not [r for r in out.values() if "error" in r], out
    _check_steps(out)
    for name, r in out.items():  # [L, X, H, F]: 4 experts 128 x 64, split one way or the other
        tp = int(name.rpartition("/tp")[2])
        rows = 64 if "#int4" in name else 128  # (4-bit: two rows a byte)
        want = [2, 4 // tp, rows, 64] if "-ep" in name else [2, 4, rows, 64 // tp]
        assert r["expert_shard"] == want, (name, r)


@pytest.mark.slow  # 23-32 s; .ci/run runs it
def test_a_vocabulary_the_mesh_does_not_divide_is_padded():
    """Issue 51, item 5: a vocabulary of 211 was refused at tp 2, 4 and 8. Padded as
    vLLM's vocabulary-parallel embedding pads it, the logits and tokens are those of one
    device (the padding columns never reach the sampler). (tp 2 and 4: -m slow, below.)"""
    out = _worker("tp_worker.py", "xla", "vocab-211:8")  # 5 padding columns
    assert set(out) == {"vocab-211/tp8"}
    assert not [k for k, r in out.items() if "error" in r], out
    _check_steps(out)


@pytest.mark.slow  # the default suite runs the engine at tp 2 x dp 2 (below)
def test_tensor_parallel_steps_equal_one_device():
    # tiny-llama: 4 query heads, 2 KV heads; gqa-8-2 at 4: each KV head on 2 devices
    # vocab-211 at 2 and 4: a padding column or three (8: the default suite, above)
    out = _worker("tp_worker.py", "xla", "tiny-llama:2,8", "gqa-8-2:4", "vocab-211:2,4")
    _check_steps(out)
    assert {k for k, r in out.items() if "error" not in r} == {
        "tiny-llama/tp2",
        "gqa-8-2/tp4",
        "vocab-211/tp2",
        "vocab-211/tp4",
    }
    # replicated KV heads: 4 devices hold 2 copies of each of the 2 heads, one each
    # (2 layers x 64 pages x 8 tokens x (K and V of 4 heads) x 16 dims x 4 bytes)
    assert out["gqa-8-2/tp4"]["total_cache_bytes"] == 2 * 64 * 8 * (2 * 4) * 16 * 4
    assert out["tiny-llama/tp8"]["error"] == (
        "tensor_parallel_size: 8 must divide num_heads=4, and divide num_kv_heads=2 or be "
        "a multiple of it"
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "backend,grid",
    [
        ("xla", ["tiny-llama:2,4", "gqa-8-4:2,4,8", "gqa-8-2:2,4,8"]),
        ("pallas_gpu", ["gqa-8-2:2,4"]),  # interpret mode
        ("pallas_tpu", ["gqa-8-2:4"]),  # interpret mode
    ],
)
def test_tensor_parallel_grid(backend, grid):
    out = _worker("tp_worker.py", backend, *grid)
    assert not [k for k, r in out.items() if "error" in r], out
    _check_steps(out)


def _check_engine(out: dict, ref: dict) -> None:
    for spec, r in out.items():
        tp, _, dp = spec.partition("x")
        tp, dp = int(tp), int(dp or 1)
        # greedy, seeded top-p / top-k and n=2 samples: token for token as on one device
        assert r["tokens"] == ref["tokens"], spec
        # the pool: dp pools of 14 pages, each split along heads over its tp devices
        assert r["total_cache_bytes"] == dp * ref["total_cache_bytes"] * max(2, tp) // 2, r
        assert r["device_cache_bytes"] * tp * dp == r["total_cache_bytes"], r
        # and the compiled step takes that share of it (its memory analysis, per device;
        # within the metadata arguments XLA drops as unused: up to 1.6 KiB of a 56 KiB
        # share in a decode-only step, far from the half or whole pool of a wrong split)
        share = r["device_cache_bytes"]
        assert abs(r["compiled_cache_bytes"] - share) < share // 16, r
        # data parallel: the 4 requests (one of 2 samples) went to the least loaded
        # replicas; up to 2 replicas, 2 requests share a 14-page pool and preempt
        # (swapping K/V of the split pool out and back)
        assert r["replica_requests"] == {1: [4], 2: [2, 2], 4: [1, 1, 1, 1]}[dp], r
        assert r["preemptions"] > 0 or dp > 2, r
        # 2 KV heads: above tp 2 each is repeated, one copy per device
        assert r["kv_heads"] == max(2, tp), r
        assert r["pool_collectives"] == 0, r
        # tp: the partial sums after o and down (dp alone: the logits rows, a small one)
        assert r["all_reduces"] > 0 or tp == 1, r
        # one compilation per bucket; a bucket's step may have a second dispatch entry,
        # for input tokens merged on the device (the same executable, not counted again)
        assert r["compilations"] <= r["compiled_steps"] <= 2 * r["compilations"], r


@pytest.mark.slow  # 15 s (a worker process); .ci/run runs it
def test_a_draft_model_and_embeddings_on_a_tensor_parallel_mesh():
    """At tensor-parallel size 2 a draft model proposes as on one device (its pool split
    along heads, half a device) and the tokens are one device's; embeddings too."""
    out = _worker("mesh_worker.py", "draft")
    one, two = out["1"], out["2"]
    assert two["tokens"] == one["tokens"] and two["failed"] == 0
    assert two["proposed"] == one["proposed"] > 0
    assert one["draft_pool_share"] == 1.0 and two["draft_pool_share"] == 0.5
    np.testing.assert_allclose(two["embeddings"], one["embeddings"], atol=1e-5)


@pytest.mark.slow  # 14 s (a worker process); .ci/run runs it, tests/test_routing.py the rule
def test_data_parallel_requests_go_where_their_prefix_is_cached():
    """2 replicas, a wave of one prompt of each of two families (a 24-token system
    prompt each), then a wave of A A B B: routed by prefix, each family stays on its
    replica and every request of the second wave hits its 3 pages (least loaded
    alone, half of them land where their prefix is not); the tokens are one device's."""
    out = _worker("mesh_worker.py", "routing")
    one, prefix, least = out["one"], out["prefix"], out["least_loaded"]
    assert prefix["tokens"] == least["tokens"] == one["tokens"]
    assert prefix["replicas"] == [0, 1, 0, 0, 1, 1]
    assert least["replicas"] == [0, 1, 0, 1, 0, 1]
    assert prefix["hits"] == one["hits"] == 4 * 24 and least["hits"] == 2 * 24


@pytest.mark.slow  # 30-40 s on 2 cores (two worker processes); .ci/run runs it
def test_engine_under_tensor_and_data_parallelism_matches_one_device():
    out = _worker("mesh_worker.py", "engine", "1,2x2")
    ref = out.pop("1")
    each = "a multiple of data_parallel_size=2 (each replica's pool has its own)"
    assert out.pop("errors") == [
        f"num_pages: expected an int >= 4 (page 0 is null), {each}, got 15",
        f"num_pages: expected an int >= 4 (page 0 is null), {each}, got 2",
        "bm: this engine has 2 data-parallel replicas; use block_managers[r]",
    ]
    # the 14-page pool preempted (swapping K/V of the sharded cache out and back) and the
    # n=2 samples shared pages (copy-on-write of the last prompt page)
    assert ref["preemptions"] > 0 and ref["max_pages_shared"] > 0, ref
    assert out["2x2"]["max_pages_shared"] > 0, out["2x2"]
    _check_engine(out, ref)


@pytest.mark.slow
def test_engine_parallel_grid():
    out = _worker("mesh_worker.py", "engine", "1,2,4,8,1x2,1x4,2x4,4x2")
    ref = out.pop("1")
    out.pop("errors")  # checked by the test above
    # tensor parallel alone: the same steps as one device
    assert out["4"]["preemptions"] == ref["preemptions"], out["4"]
    assert out["4"]["compilations"] == ref["compilations"]
    _check_engine(out, ref)


@pytest.mark.slow
def test_engine_parallel_tiny_llama():
    out = _worker("mesh_worker.py", "engine", "1,2,4,1x2,2x2,4x2", "tiny-llama")
    ref = out.pop("1")
    out.pop("errors")
    _check_engine(out, ref)


@pytest.mark.slow  # 40-60 s; .ci/run runs it
def test_engine_with_experts_split_by_expert_matches_one_device():
    """A mixture sharded with expert_parallel (8 experts: 4, 2 or 1 on each device, also
    beside data-parallel replicas): the engine's tokens of one device, swap and forks
    included."""
    out = _worker("mesh_worker.py", "engine", "1,2,4,8,2x2", "moe-ep")
    ref = out.pop("1")
    out.pop("errors")
    assert ref["preemptions"] > 0, ref
    _check_engine(out, ref)


@pytest.mark.slow  # 15-20 s: three CLI processes
def test_the_cli_splits_a_mixture_by_expert():
    """``paged-jax generate --tensor-parallel-size 2 --enable-expert-parallel`` on the
    golden Mixtral (2 fake CPU devices, f32): the tokens of one device and of the width
    split; a dense model refused naming the flag."""
    import os

    env = dict(
        os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu"
    )
    argv = ["-m", "paged_jax.cli", "generate", "--no-progress", "--dtype", "float32"]
    argv += ["--prompt-ids", "3,7,3,7,3,7", "--max-tokens", "8", "--temperature", "0"]
    mixtral = ["--model", str(HERE / "golden" / "hf" / "mixtral")]
    lines = []
    for extra in (
        [],
        ["--tensor-parallel-size", "2"],
        ["--tensor-parallel-size", "2", "--enable-expert-parallel"],
    ):
        done = subprocess.run(
            [sys.executable, *argv, *mixtral, *extra], capture_output=True, text=True,
            timeout=300, env=env,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        lines.append(next(x for x in done.stdout.splitlines() if "token ids" in x))
    assert lines[0] == lines[1] == lines[2], lines
    dense = ["--model", "tiny-llama", "--tensor-parallel-size", "2", "--enable-expert-parallel"]
    done = subprocess.run(
        [sys.executable, *argv, *dense], capture_output=True, text=True, timeout=300, env=env
    )
    assert (
        done.returncode == 2
        and "--enable-expert-parallel: expert_parallel: the model has no experts" in done.stderr
    )


@pytest.mark.slow
def test_engine_tensor_parallel_on_a_hybrid_pool():
    """Gemma 3's layer groups (sliding ones dropping pages) split along KV heads: the same
    tokens as one device, swap preemption included."""
    out = _worker("mesh_worker.py", "engine", "1,2,4", "gemma3")
    ref = out.pop("1")
    out.pop("errors")
    assert ref["hybrid"] and ref["preemptions"] > 0, ref
    for spec, r in out.items():
        assert r["hybrid"] and r["tokens"] == ref["tokens"], spec
        assert r["device_cache_bytes"] * int(spec) == r["total_cache_bytes"], spec
        assert r["pool_collectives"] == 0, spec


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_form_one_mesh():
    """2 processes x 4 CPU devices (gloo collectives on localhost) run the engine at
    tensor-parallel 8, then at tensor-parallel 4 x data-parallel 2 (a replica per
    process); process 0 returns what one process on one device returns, the other
    returns nothing. Both stop by themselves (bounded by the timeout)."""
    ref = _worker("mesh_worker.py", "engine", "1")["1"]
    port = str(_free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, str(HERE / "mesh_worker.py"), "host", str(pid), port, "8,4x2"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for pid in (0, 1)
    ]
    outs = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=300)
            assert p.returncode == 0, stderr[-3000:]
            outs.append(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        for p in procs:
            p.kill()
    for spec, kv_heads in (("8", 8), ("4x2", 4)):
        main, other = outs[0][spec], outs[1][spec]
        assert (main["process"], other["process"], main["devices"]) == (0, 1, 8)
        assert main["tokens"] == ref["tokens"], spec
        assert other["tokens"] == [], spec
        assert main["kv_heads"] == kv_heads, spec
        assert main["device_cache_bytes"] * 8 == main["total_cache_bytes"], spec
        assert main["pool_collectives"] == 0 and main["all_reduces"] > 0, spec


_MESH_CASES = """
import json, os, jax, numpy as np
import paged_jax as pj
from paged_jax import models
from paged_jax.models import LlamaConfig, init_model
out = {}
p = pj.SamplingParams(max_tokens=6, logprobs=True)
prompts = [[1, 2, 3], [5, 6]]

def run(model, mesh=None):
    got = pj.LLM(model, mesh=mesh).generate(prompts, p, progress=False)
    return [(o.outputs[0].token_ids, [float(x) for x in o.outputs[0].logprobs]) for o in got]

cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16)
explicit = jax.make_mesh((2,), ("tp",))  # Explicit axes, JAX's default
out["explicit"] = {"axis_types": [str(t) for t in explicit.axis_types],
                   "one": run(init_model(cfg, seed=0)),
                   "mesh": run(init_model(cfg, seed=0), explicit)}
mesh = pj.parallel_mesh(2, 1)
for tied in (False, True):  # a vocabulary of 131: padded to 132 over 2 devices
    cfg = LlamaConfig(vocab_size=131, hidden_size=64, intermediate_size=128, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, tie_word_embeddings=tied)
    for fmt in ("int8", "int4", "fp8"):
        m = init_model(cfg, seed=3).quantize(fmt)
        mesh_run = run(m, mesh)
        down = m.layers.mlp.down_proj
        out[f"{fmt}-{'tied' if tied else 'untied'}"] = {
            "one": run(init_model(cfg, seed=3).quantize(fmt)), "mesh": mesh_run,
            "down_spec": str(down.kernel.get_value().sharding.spec), "rotated": down.rotated}
m, _ = models.load("tiny-llama", mesh=mesh, quantization="int8")
out["load"] = {"q_spec": str(m.layers.self_attn.q_proj.kernel.get_value().sharding.spec),
               "q_dtype": str(m.layers.self_attn.q_proj.kernel.get_value().dtype)}
os.environ.pop("PAGED_JAX_BACKEND")  # the C kernels' packing, where they build
try:
    init_model(cfg, seed=3).quantize("int8").hold_for_cpu().shard(mesh)
    out["packed"] = None
except ValueError as e:
    out["packed"] = str(e)
print(json.dumps(out))
"""


@pytest.mark.slow  # a process of its own with 2 fake devices, 20-30 s; .ci/run runs it
def test_explicit_axes_and_quantized_weights_on_a_mesh(tmp_path):
    """``jax.make_mesh`` gives Explicit axes by default, under which every request failed
    at its first step (the embedding's gather could not resolve its sharding): the
    engine takes the mesh's devices with Auto axes and gives one device's tokens.
    Quantized weights (int8 rotated in groups, int4, fp8; tied and untied heads; a
    vocabulary the mesh pads) split as their float kernels, scales alongside: the same
    tokens and log-probs as one device with XLA's products; ``models.load`` quantizes
    into the shards; weights packed for the CPU kernels are refused by ``shard``."""
    import os

    env = dict(
        os.environ,
        XLA_FLAGS="--xla_force_host_platform_device_count=2",
        PAGED_JAX_BACKEND="xla",  # one device computes as the mesh does (W8A16)
    )
    out = _run(["-c", _MESH_CASES], env=env, cwd=tmp_path)
    explicit = out.pop("explicit")
    assert "Explicit" in explicit["axis_types"][0], explicit  # (the case: not Auto already)
    out["explicit"] = explicit  # the same tokens and log-probs, below
    load, packed = out.pop("load"), out.pop("packed")
    assert load["q_dtype"] == "int8" and "tp" in load["q_spec"], load
    if linear.available():  # (packed only where the C kernels built)
        assert packed and "packed for the CPU kernels" in packed, packed
    assert len(out) == 7
    for case, r in out.items():
        if case != "explicit":
            assert r["down_spec"] == "P(None, 'tp', None)", (case, r)
            assert r["rotated"] == case.startswith("int8"), (case, r)
        for (ids1, lp1), (ids2, lp2) in zip(r["one"], r["mesh"], strict=True):
            assert ids1 == ids2 and len(ids1) == 6, (case, r)
            np.testing.assert_allclose(lp2, lp1, atol=1e-4, err_msg=case)

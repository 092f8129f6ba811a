"""Start-up: the persistent compilation cache (a second process loads compiled steps), the
warm-up that compiles a workload's buckets up front, a trace that does not grow with depth,
and CPU defaults (16-bit checkpoints in f32 without native bf16, a KV pool sized from
memory)."""

import json
import logging
import os
import pathlib
import re
import subprocess
import sys

import jax
import pytest
from conftest import FAST_COMPILE

import paged_jax as pj
from paged_jax import models
from paged_jax.engine import compile_cache

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_resolve_follows_argument_then_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv(compile_cache.CACHE_ENV, raising=False)
    monkeypatch.delenv("PAGED_JAX_CACHE", raising=False)  # (the root, which a user may set)
    assert compile_cache.resolve(None) == tmp_path / "xdg" / "paged-jax" / "xla"
    assert compile_cache.resolve(True) == tmp_path / "xdg" / "paged-jax" / "xla"
    assert compile_cache.resolve(False) is None
    assert compile_cache.resolve(tmp_path / "mine") == tmp_path / "mine"
    for off in ("0", "off", "OFF", "false"):
        monkeypatch.setenv(compile_cache.CACHE_ENV, off)
        assert compile_cache.resolve(None) is None
    monkeypatch.setenv(compile_cache.CACHE_ENV, str(tmp_path / "env"))
    assert compile_cache.resolve(None) == tmp_path / "env"
    assert compile_cache.resolve(False) is None  # the argument wins over the environment
    with pytest.raises(TypeError, match="compilation_cache: expected a bool"):
        compile_cache.resolve(3)


def test_enable_keeps_a_directory_the_process_chose(tmp_path):
    before = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "chosen"))
    try:
        assert compile_cache.enable(tmp_path / "other") == tmp_path / "chosen"
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "chosen")
    finally:
        jax.config.update("jax_compilation_cache_dir", before)


_CHILD = """
import json, sys
import jax
hits = []
jax.monitoring.register_event_listener(
    lambda name, **kw: hits.append(name) if name.endswith("cache_hits") else None)
import paged_jax as pj
from paged_jax import models
llm = pj.LLM(*models.load("tiny-llama"), num_pages=64, page_size=8, compilation_cache=sys.argv[1])
out = llm.generate([[1, 2, 3, 4, 5]], pj.SamplingParams(max_tokens=4), progress=False)
print(json.dumps(dict(tokens=out[0].outputs[0].token_ids, hits=len(hits),
                      compilations=llm.metrics.compilations)))
"""


@pytest.mark.slow  # 15-20 s: two processes compile and load; .ci/run runs it
def test_second_process_loads_compiled_steps(tmp_path):
    cache = tmp_path / "xla"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop(compile_cache.CACHE_ENV, None)
    # compiled with XLA's defaults, as users compile (conftest's faster compiling flags
    # compile this tiny model under the cache's 0.2 s threshold)
    flags = "|".join(FAST_COMPILE)
    env["XLA_FLAGS"] = re.sub(rf"--({flags})=\S*", "", env.get("XLA_FLAGS", "")).strip()

    def child():
        r = subprocess.run(
            [sys.executable, "-c", _CHILD, str(cache)],
            capture_output=True,
            text=True,
            env=env,
            cwd=REPO,
            timeout=300,
        )
        assert r.returncode == 0, r.stderr[-2000:]
        return json.loads(r.stdout.strip().splitlines()[-1])

    first = child()
    assert first["hits"] == 0 and first["compilations"] >= 1
    assert any(cache.iterdir()), "the first process wrote no compiled step"
    second = child()
    assert second["hits"] >= first["compilations"]  # every step bucket came from disk
    assert second["tokens"] == first["tokens"]


def _own_model(hidden: int, num_layers: int = 2):
    """A model whose graph no other test compiled (engines share compiled steps per model
    structure, so a fresh structure makes the warm-up compile)."""
    cfg = models.LlamaConfig(
        vocab_size=320,
        hidden_size=hidden,
        intermediate_size=64,
        num_layers=num_layers,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        max_position_embeddings=256,
    )
    return models.init_model(cfg, seed=0)


def test_warm_up_compiles_what_the_workload_then_uses(caplog, capsys):
    llm = pj.LLM(_own_model(40), num_pages=64, page_size=8, compilation_cache=False)
    with caplog.at_level(logging.INFO, logger="paged_jax"):
        buckets = llm.warm_up(num_seqs=3, prompt_len=20, max_tokens=6)
    assert buckets and buckets == llm.compiled_buckets
    assert {"tokens", "seqs", "pages_per_seq", "copies", "seconds"} <= set(buckets[0])
    printed = capsys.readouterr().err
    assert printed.count("warm-up: compiled a step bucket") == len(buckets)
    assert llm.metrics.steps == 0 and llm.metrics.compilations == 0  # reset after warm-up
    prompts = [[5 + i] * 20 for i in range(3)]
    llm.generate(prompts, pj.SamplingParams(max_tokens=6, ignore_eos=True), progress=False)
    assert llm.metrics.compilations == 0  # the same workload: nothing left to compile
    assert llm.warm_up(num_seqs=3, prompt_len=20, max_tokens=6, progress=False) == []


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_seqs=0, prompt_len=4, max_tokens=4), "num_seqs: expected an int >= 1"),
        (dict(num_seqs=1, prompt_len=4.5, max_tokens=4), "prompt_len: expected an int >= 1"),
        (dict(num_seqs=1, prompt_len=200, max_tokens=100), "prompt_len \\+ max_tokens"),
    ],
)
def test_warm_up_names_a_bad_argument(kwargs, match):
    llm = pj.LLM(_own_model(48), num_pages=16, page_size=8, compilation_cache=False)
    with pytest.raises(ValueError, match=match):
        llm.warm_up(**kwargs)
    assert llm.compiled_buckets == []


def test_compiled_layer_body_is_traced_once_whatever_the_depth():
    """Layers run as one scan: a 2-layer and a 6-layer model lower to programs of the same
    size (an unrolled loop grows with depth, and so did compile time: 74 s for SmolLM2)."""
    sizes = []
    for depth in (2, 6):
        model = _own_model(32, num_layers=depth)
        step, state = models.make_step(model)
        cache = model.make_cache(8, 8)
        bm = pj.BlockManager(8, 8, enable_prefix_caching=False)
        bm.allocate(0, [1, 2, 3])
        batch = pj.build_batch(bm, [pj.ScheduledSeq(0, 0, 3)])
        md = pj.AttentionMetadata.from_batch(batch)
        args = (jax.numpy.asarray(batch.token_ids), jax.numpy.asarray(batch.positions))
        sizes.append(len(step.lower(state, *args, cache, md).as_text()))
    assert abs(sizes[1] - sizes[0]) < 0.02 * sizes[0], sizes


# ---------------------------------------------------------------- CPU defaults
def _bf16_checkpoint(path, hidden=32):
    import ml_dtypes
    import numpy as np
    from safetensors.numpy import save_file

    from paged_jax.models.hf import to_hf_tensors

    hf = dict(
        architectures=["LlamaForCausalLM"],
        vocab_size=64,
        hidden_size=hidden,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
        torch_dtype="bfloat16",
    )
    model = models.init_model(models.LlamaConfig.from_hf(hf), seed=2)
    tensors = {k: v.astype(ml_dtypes.bfloat16) for k, v in to_hf_tensors(model).items()}
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(hf))
    return path, model, {k: np.asarray(v) for k, v in tensors.items()}


def test_hf_tensors_round_trip_through_the_loader(tmp_path):
    import numpy as np

    from paged_jax.models.hf import load_hf, to_hf_tensors

    path, _, tensors = _bf16_checkpoint(tmp_path / "ckpt")
    loaded, _ = load_hf(path)
    again = to_hf_tensors(loaded)
    assert sorted(again) == sorted(tensors)
    assert "model.layers.2.mlp.down_proj.weight" in again  # per layer, HF names
    for name, value in tensors.items():
        np.testing.assert_array_equal(again[name], value, err_msg=name)


def test_bf16_checkpoint_runs_in_f32_on_a_cpu_without_bf16(tmp_path, monkeypatch, caplog):
    from paged_jax.models import loading

    path, _, _ = _bf16_checkpoint(tmp_path / "ckpt")
    monkeypatch.setattr(loading, "_cpu_has_native_bf16", lambda: False)
    with caplog.at_level(logging.WARNING, logger="paged_jax"):
        model, _ = models.load(str(path))
    assert model.dtype == jax.numpy.float32
    assert model.embed_tokens.embedding[...].dtype == jax.numpy.float32
    assert [r.message for r in caplog.records].count(
        f"{path}: bfloat16 weights computed in float32 (this CPU has no native bf16, "
        "which runs several times slower); pass dtype='bfloat16' to keep them as stored"
    ) == 1
    kept, _ = models.load(path, dtype="bfloat16")
    assert kept.dtype == jax.numpy.bfloat16
    monkeypatch.setattr(loading, "_cpu_has_native_bf16", lambda: True)
    native, _ = models.load(path)
    assert native.dtype == jax.numpy.bfloat16


def test_default_kv_pool_on_cpu_follows_available_memory(monkeypatch):
    from paged_jax.engine import devices as llm_mod

    GiB = 2**30
    monkeypatch.setattr(llm_mod, "_free_memory", lambda: (8 * GiB, "this machine"))
    assert llm_mod._default_budget(100 * GiB) == 2 * GiB  # a quarter of what is available
    assert llm_mod._default_budget(GiB // 2) == GiB // 2  # no more than can be used
    monkeypatch.setattr(llm_mod, "_free_memory", lambda: (64 * GiB, "this machine"))
    assert llm_mod._default_budget(100 * GiB) == llm_mod.CPU_KV_CACHE_MAX_BYTES
    monkeypatch.setattr(llm_mod, "_free_memory", lambda: (None, "this machine"))
    assert llm_mod._default_budget(100 * GiB) == 256 * 2**20
    # An engine's pool: what a full batch at the longest context fills, no more.
    monkeypatch.setattr(llm_mod, "_free_memory", lambda: (8 * GiB, "this machine"))
    llm = pj.LLM(_own_model(32), page_size=8, max_num_seqs=4, compilation_cache=False)
    assert llm.bm.num_pages == 4 * (256 // 8) + 1

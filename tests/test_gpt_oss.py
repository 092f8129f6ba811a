"""GPT-OSS: its config, YaRN, its checkpoints' layout (experts as one tensor a projection,
gate and up interleaved; MXFP4 blocks), and the engine's features on it.

Parity with transformers (logits, greedy tokens, forks, prefix hits, the hybrid pool,
the routers' choices) is tests/test_hf_golden.py's, on the golden GPT-OSS; attention
sinks on each backend are tests/test_sinks.py's.
"""

import json
import pathlib
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from hf_cases import PROMPTS
from safetensors.numpy import load_file, save_file

import paged_jax as pj
from paged_jax.models import LlamaConfig, load_hf
from paged_jax.models import gpt_oss as gpt_oss_tensors
from paged_jax.models.config import YarnRopeScaling
from paged_jax.models.hf import to_hf_tensors

GOLDEN = pathlib.Path(__file__).resolve().parent / "golden" / "hf" / "gptoss"


def _hf() -> dict:
    return json.loads((GOLDEN / "config.json").read_text())


@pytest.fixture(scope="module")
def golden():
    model, _ = load_hf(GOLDEN, dtype=jnp.float32)
    return model


def test_the_config_reads_gpt_oss_s_fields():
    cfg = LlamaConfig.from_hf(_hf())
    assert cfg.architecture == "GptOssForCausalLM" and cfg.attention_sinks
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (4, 2, 64)
    assert (cfg.router_scoring, cfg.moe_bias, cfg.swiglu_limit, cfg.swiglu_alpha) == (
        "topk_softmax",
        True,
        1.0,
        1.702,
    )
    assert cfg.qkv_bias and cfg.o_bias and cfg.sliding_window == 8
    assert cfg.layer_types == ("sliding_attention", "full_attention") and cfg.layer_period == 2
    y = cfg.rope_scaling
    assert isinstance(y, YarnRopeScaling) and not y.truncate
    assert (y.factor, y.original_max_position_embeddings) == (4.0, 32)
    assert y.attention_factor == pytest.approx(0.1 * np.log(4.0) + 1)  # transformers' rule
    # transformers' defaults where a config leaves them out
    bare = {k: v for k, v in _hf().items() if k not in ("layer_types", "sliding_window")}
    cfg = LlamaConfig.from_hf(bare)
    assert cfg.sliding_window == 128 and cfg.layer_types == ("sliding_attention", "full_attention")


def test_yarn_needs_its_original_context_and_takes_a_given_attention_factor():
    rope = {**_hf()["rope_parameters"]}
    del rope["original_max_position_embeddings"]
    with pytest.raises(ValueError, match="yarn rope scaling needs original_max_position"):
        LlamaConfig.from_hf({**_hf(), "rope_parameters": rope})
    rope = {**_hf()["rope_parameters"], "attention_factor": 1.25}
    assert (
        LlamaConfig.from_hf({**_hf(), "rope_parameters": rope}).rope_scaling.attention_factor
        == 1.25
    )
    with pytest.raises(ValueError, match="rope_scaling.factor: expected > 0"):
        YarnRopeScaling(factor=0.0, original_max_position_embeddings=32)


def _e2m1(n: int) -> float:
    """One 4-bit E2M1 number from its bits: sign, two exponent bits, one mantissa bit."""
    sign = -1.0 if n & 8 else 1.0
    exp, man = (n >> 1) & 3, n & 1
    return sign * (man * 0.5 if exp == 0 else (1 + man / 2) * 2.0 ** (exp - 1))


def _dequantize(blocks, scales):
    """The test's own MXFP4 reading, element by element: ``[..., G, 16]`` -> ``[..., G * 32]``."""
    out = np.zeros((*blocks.shape[:-1], 32))
    for idx in np.ndindex(*blocks.shape[:-1]):
        scale = 2.0 ** (int(scales[idx]) - 127)
        for j, byte in enumerate(blocks[idx]):
            out[(*idx, 2 * j)] = _e2m1(int(byte) & 15) * scale
            out[(*idx, 2 * j + 1)] = _e2m1(int(byte) >> 4) * scale
    return out.reshape(*blocks.shape[:-2], -1)


def test_mxfp4_blocks_read_as_their_bits_say():
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (3, 5, 2, 16), dtype=np.uint8)
    scales = rng.integers(118, 136, (3, 5, 2), dtype=np.uint8)
    got = gpt_oss_tensors.dequantize_mxfp4(blocks, scales)
    assert got.shape == (3, 5, 64) and got.dtype == np.float32
    np.testing.assert_array_equal(got, _dequantize(blocks, scales))
    with pytest.raises(ValueError, match=r"mxfp4: expected blocks \[..., G, 16\]"):
        gpt_oss_tensors.dequantize_mxfp4(blocks[..., :8], scales)


def _mxfp4_checkpoint(tmp_path) -> tuple[pathlib.Path, pathlib.Path]:
    """The golden GPT-OSS with its experts' weights replaced by random MXFP4 blocks: as
    blocks (``quant_method: mxfp4``), and as the floats they stand for."""
    rng = np.random.default_rng(1)
    tensors = load_file(GOLDEN / "model.safetensors")
    quantized, floats = dict(tensors), dict(tensors)
    for name in [n for n in tensors if n.endswith(("gate_up_proj", "down_proj"))]:
        X, inputs, outputs = tensors[name].shape  # [X, in, out]
        blocks = rng.integers(0, 256, (X, outputs, inputs // 32, 16), dtype=np.uint8)
        scales = rng.integers(122, 128, (X, outputs, inputs // 32), dtype=np.uint8)
        del quantized[name]
        quantized[name + "_blocks"], quantized[name + "_scales"] = blocks, scales
        floats[name] = np.ascontiguousarray(
            np.swapaxes(_dequantize(blocks, scales), 1, 2), np.float32
        )
    paths = []
    for kind, t in (("mxfp4", quantized), ("float", floats)):
        path = tmp_path / kind
        path.mkdir()
        cfg = _hf()
        if kind == "mxfp4":
            cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": []}
        (path / "config.json").write_text(json.dumps(cfg))
        floats_or_blocks = {
            k: v if v.dtype == np.uint8 else v.astype(np.float32) for k, v in t.items()
        }
        save_file(floats_or_blocks, path / "model.safetensors")
        paths.append(path)
    return paths[0], paths[1]


def test_an_mxfp4_checkpoint_loads_as_the_floats_its_blocks_stand_for(tmp_path):
    quantized, floats = _mxfp4_checkpoint(tmp_path)
    a, _ = load_hf(quantized, dtype=jnp.float32)
    b, _ = load_hf(floats, dtype=jnp.float32)
    got, want = to_hf_tensors(a), to_hf_tensors(b)
    assert set(got) == set(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    scales = load_file(quantized / "model.safetensors")
    del scales["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(scales, quantized / "model.safetensors")
    with pytest.raises(ValueError, match="tensor 'model.layers.1.mlp.experts.down_proj_scales' is"):
        load_hf(quantized)


def test_the_model_writes_back_the_checkpoint_it_read(golden):
    """``to_hf_tensors`` gives GPT-OSS's own names and layouts (experts stacked, gate and
    up interleaved again), tensor for tensor the file's."""
    stored = load_file(GOLDEN / "model.safetensors")
    written = to_hf_tensors(golden)
    assert set(written) == set(stored)
    for name, value in stored.items():
        np.testing.assert_array_equal(written[name], value.astype(np.float32), err_msg=name)


def test_other_experts_than_the_config_says_are_refused(tmp_path):
    path = tmp_path / "ck"
    shutil.copytree(GOLDEN, path)
    (path / "config.json").write_text(json.dumps({**_hf(), "num_local_experts": 3}))
    with pytest.raises(ValueError, match="num_experts: the config says 3 experts a layer"):
        load_hf(path)


@pytest.mark.parametrize("held", ["accelerator", "cpu"])
def test_held_for_each_device_it_keeps_transformers_logits(held):
    from model_helpers import paged_prompt_logits

    model, _ = load_hf(GOLDEN, dtype=jnp.float32)
    model = model.hold_for_accelerator() if held == "accelerator" else model.hold_for_cpu()
    golden = np.load(GOLDEN / "golden.npz")["logits"]
    logits = paged_prompt_logits(model, PROMPTS["long"])
    assert np.abs(logits - golden).max() / np.abs(golden).max() <= 1e-4


def test_the_engine_s_features_keep_its_tokens(golden):
    """The engine (prefix cache, a prompt that hits another's pages), plain and with
    n-gram speculation, gives transformers' greedy tokens."""
    want = np.load(GOLDEN / "golden.npz")
    prompts = [PROMPTS["long"], PROMPTS["mid"], PROMPTS["hit"]]
    sp = pj.SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    for extra in ({}, {"speculative": {"method": "ngram", "num_speculative_tokens": 3}}):
        llm = pj.LLM(golden, num_pages=96, page_size=8, compilation_cache=False, **extra)
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, progress=False)]
        for name, out in zip(("long", "mid", "hit"), outs, strict=True):
            assert out == want[f"greedy_{name}"][:16].tolist(), (extra, name)


@pytest.mark.hf
def test_mxfp4_reads_as_transformers_reads_it():
    """The same blocks through transformers' own MXFP4 reading (its ``[X, in, out]``)."""
    torch = pytest.importorskip("torch", reason="pytest -m hf needs torch (a CPU build)")
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    rng = np.random.default_rng(2)
    blocks = rng.integers(0, 256, (3, 8, 4, 16), dtype=np.uint8)
    scales = rng.integers(110, 140, (3, 8, 4), dtype=np.uint8)
    theirs = mxfp4.convert_moe_packed_tensors(
        torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32
    ).numpy()
    ours = np.swapaxes(gpt_oss_tensors.dequantize_mxfp4(blocks, scales), 1, 2)
    np.testing.assert_array_equal(ours, theirs)

"""Quantized Hugging Face checkpoints (issue 52, item 3): compressed-tensors' 8-bit
weights, fp8 and int8, per channel and per tensor, kept as stored and computing what a
float checkpoint holding the dequantized weights computes; the schemes not read are
refused by name."""

import json
import pathlib
import shutil

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import paged_jax as pj
from paged_jax.models.compressed import read_safetensors
from paged_jax.models.hf import load_hf
from paged_jax.models.quantization import quantize_fp8, quantize_int8

GOLDEN = pathlib.Path(__file__).parent / "golden" / "hf" / "llama"


def _group(kind="float", strategy="channel", **weights):
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized" if kind == "float" else "int-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 8,
                    "type": kind,
                    "strategy": strategy,
                    "symmetric": True,
                    "dynamic": False,
                    **weights,
                },
                "input_activations": {
                    "num_bits": 8,
                    "type": kind,
                    "strategy": "token",
                    "dynamic": True,
                    "symmetric": True,
                },
            }  # fmt: skip
        },
        "ignore": ["lm_head"],
    }


def _checkpoint(tmp_path, kind="float", strategy="channel", qc=None):
    """(a quantized checkpoint's directory, a float one holding its dequantized weights):
    the golden Llama's projections quantized as compressed-tensors stores them, the
    embedding, norms and LM head left as they are."""
    tensors = load_file(str(GOLDEN / "model.safetensors"))
    quant, dequant = {}, {}
    for name, w in tensors.items():
        w32 = np.asarray(w, np.float32)
        if ".layers." not in name or not name.endswith("proj.weight"):
            quant[name] = dequant[name] = w
            continue
        if strategy == "tensor":  # one scale: every channel's the largest
            big = np.full_like(w32, np.abs(w32).max())
            big[:, 1:] = w32[:, 1:]
            _, s = (quantize_fp8 if kind == "float" else quantize_int8)(big, axis=1)
            scale = np.float32(s.max())
            q = w32 / scale
            q = q.astype(ml_dtypes.float8_e4m3fn) if kind == "float" else np.rint(q).astype(np.int8)
            quant[f"{name}_scale"] = np.asarray([scale], np.float32)
            dequant[name] = q.astype(np.float32) * scale  # (f32: exact)
        else:
            q, s = (quantize_fp8 if kind == "float" else quantize_int8)(w32, axis=1)
            quant[f"{name}_scale"] = s[:, None].astype(ml_dtypes.bfloat16)
            s = s.astype(ml_dtypes.bfloat16).astype(np.float32)  # as the file holds it
            dequant[name] = q.astype(np.float32) * s[:, None]
        quant[name] = q
        quant[name.removesuffix("weight") + "input_scale"] = np.ones(1, np.float32)
    dirs = []
    for label, ts in (("quantized", quant), ("float", dequant)):
        d = tmp_path / label
        d.mkdir()
        save_file(ts, str(d / "model.safetensors"))
        config = json.loads((GOLDEN / "config.json").read_text())
        if label == "quantized":
            config["quantization_config"] = qc or _group(kind, strategy)
        (d / "config.json").write_text(json.dumps(config))
        dirs.append(d)
    return dirs


@pytest.mark.parametrize(
    "kind, strategy", [("float", "channel"), ("float", "tensor"), ("int", "channel")]
)
def test_a_compressed_checkpoint_computes_what_its_dequantized_weights_do(
    tmp_path, kind, strategy, monkeypatch
):
    # XLA's products, weight-only: the C kernel's quantize the rows too (W8A8), which
    # tests/test_quantization.py checks against its definition.
    monkeypatch.setenv("PAGED_JAX_BACKEND", "xla")
    qdir, fdir = _checkpoint(tmp_path, kind, strategy)
    quantized, _ = load_hf(qdir, dtype="float32")
    floats, _ = load_hf(fdir, dtype="float32")
    fmt = "fp8" if kind == "float" else "int8"
    attn = quantized.layers.self_attn
    assert attn.q_proj.quantized == fmt and quantized.layers.mlp.down_proj.quantized == fmt
    want = np.dtype(ml_dtypes.float8_e4m3fn if kind == "float" else np.int8)
    assert attn.q_proj.kernel.get_value().dtype == want  # kept as stored, not widened
    assert quantized.lm_head.quantized is None  # ignored by the config: as stored
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [30, 31, 32]]
    p = pj.SamplingParams(max_tokens=8, ignore_eos=True, logprobs=True)
    kw = dict(num_pages=32, page_size=8, compilation_cache=False)
    got = pj.LLM(quantized, **kw).generate(prompts, p, progress=False)
    ref = pj.LLM(floats, **kw).generate(prompts, p, progress=False)
    for g, r in zip(got, ref, strict=True):
        assert g.outputs[0].token_ids == r.outputs[0].token_ids
        np.testing.assert_allclose(g.outputs[0].logprobs, r.outputs[0].logprobs, atol=2e-4)


def test_read_safetensors_reads_what_save_file_wrote(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {
        "a": rng.normal(size=(3, 4)).astype(np.float32),
        "b": rng.normal(size=(5,)).astype(ml_dtypes.bfloat16),
        "c": rng.normal(size=(2, 2)).astype(ml_dtypes.float8_e4m3fn),
        "d": np.arange(6, dtype=np.int8).reshape(2, 3),
        "e": np.zeros((0, 3), np.float16),
    }
    save_file(tensors, str(tmp_path / "t.safetensors"))
    got = read_safetensors(tmp_path / "t.safetensors")
    assert got.keys() == tensors.keys()
    for k, v in tensors.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape
        assert np.array_equal(got[k].view(np.uint8), v.view(np.uint8))
    (tmp_path / "bad.safetensors").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{oops")
    with pytest.raises(ValueError, match="bad.safetensors: not a safetensors header"):
        read_safetensors(tmp_path / "bad.safetensors")


@pytest.mark.parametrize(
    "qc, match",
    [
        ({"quant_method": "awq", "bits": 4}, "quant_method 'awq' is not read"),
        (_group(num_bits=4), "weights of 4 bits of type 'float'"),
        (_group(strategy="group", group_size=128), "weights' strategy 'group'"),
        (_group(symmetric=False), "asymmetric weights"),
        (
            {"quant_method": "compressed-tensors", "config_groups": {}},
            "expected one entry in config_groups",
        ),
    ],
)
def test_schemes_not_read_are_refused_by_name(tmp_path, qc, match):
    qdir, _ = _checkpoint(tmp_path, qc=qc)
    with pytest.raises(ValueError, match=r"config\.json: quantization_config: " + match):
        load_hf(qdir)


def test_a_scale_that_does_not_fit_names_the_tensor(tmp_path):
    qdir, _ = _checkpoint(tmp_path)
    tensors = read_safetensors(qdir / "model.safetensors")
    name = "model.layers.0.self_attn.q_proj.weight_scale"
    tensors[name] = np.ones((3, 1), np.float32)  # q_proj has 32 output channels
    save_file(tensors, str(qdir / "model.safetensors"))
    with pytest.raises(ValueError, match=f"tensor '{name}' has shape \\[3, 1\\], expected"):
        load_hf(qdir)
    tensors[name] = -np.ones((32, 1), np.float32)
    save_file(tensors, str(qdir / "model.safetensors"))
    with pytest.raises(ValueError, match="scales must be finite and > 0"):
        load_hf(qdir)
    shutil.rmtree(qdir)

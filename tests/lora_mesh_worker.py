"""Run by tests/test_lora.py in a fresh process with 2 fake CPU devices (the device count
is fixed when JAX starts): LoRA adapters on a tensor-parallel mesh of 2.

    python tests/lora_mesh_worker.py

Prints one JSON line: each golden adapter's (and the base model's) greedy tokens on the
"short" and "long" prompts, requests of all of them in one batch.
"""

import json
import os
import pathlib
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"
HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import jax.numpy as jnp  # noqa: E402
from hf_cases import PROMPTS  # noqa: E402

import paged_jax as pj  # noqa: E402
from paged_jax.models.hf import load_hf  # noqa: E402


def main() -> None:
    golden = HERE / "golden"
    mesh = pj.tensor_parallel_mesh(2)
    model, _ = load_hf(golden / "hf" / "llama", dtype=jnp.float32, mesh=mesh)
    llm = pj.LLM(model, max_loras=3, max_lora_rank=8, num_pages=64, page_size=8, mesh=mesh,
                 compilation_cache=False)  # fmt: skip
    names = ["attn", "mlp", "all"]
    for name in names:
        llm.add_lora(name, golden / "lora" / name)
    p = pj.SamplingParams(max_tokens=32, ignore_eos=True)
    for key in ("short", "long"):
        for name in [*names, None]:
            llm.add_request(f"{name}/{key}", PROMPTS[key], p, lora=name)
    out = {}
    while llm.has_unfinished():
        for o in llm.step():
            out[o.request_id] = o.outputs[0].token_ids
    print(json.dumps(out))


if __name__ == "__main__":
    main()

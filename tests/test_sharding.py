"""Tensor parallelism on 4 fake CPU devices (tests/tp_worker.py, in its own process: the
device count is fixed when JAX starts)."""

import json
import pathlib
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent


def test_tensor_parallel_steps_equal_one_device():
    done = subprocess.run(
        [sys.executable, str(HERE / "tp_worker.py"), "xla"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    for name in ("tiny-llama/tp2", "gqa-8-4/tp2", "gqa-8-4/tp4"):
        r = out[name]
        # prefill and 4 decode steps: logits as on one device, the same greedy tokens
        assert r["max_logit_error"] < 1e-4 and r["same_tokens"], (name, r)
        tp = int(name[-1])
        assert r["device_cache_bytes"] * tp == r["total_cache_bytes"], (name, r)
        assert r["cache_collectives"] == 0, (name, r)  # the pool never moves
        assert r["all_reduces"] > 0, (name, r)  # the partial sums after o and down do
    # tiny-llama has 2 KV heads: 4 devices would need replicated heads, not built yet
    assert out["tiny-llama/tp4"]["error"].startswith(
        "tensor_parallel_size: 4 must divide num_kv_heads=2 and num_heads=4"
    )

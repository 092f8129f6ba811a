"""llama.cpp's own batched greedy decoding of a GGUF file, for side-by-side runs
(``bench_quantization --llama-cpp PYTHON``). Runs under the Python that has
``llama-cpp-python`` (a venv of its own: it is not a dependency of paged-jax), reads
``{"model": path, "prompts": [[ids]], "output_len": n, "threads": t, "repeats": r}`` as
JSON on stdin and prints ``{"seconds": [...], "tokens": [[ids]], "version": v}``: each
repeat's wall time from the first prompt token to the last sampled one (the model loaded
once before), the first repeat's greedy tokens and llama-cpp-python's version.

All prompts are prefilled in one ``llama_decode`` call (each its own sequence), then
every step decodes one token of each sequence in one call: llama.cpp's continuous
batching as its ``batched`` example does it. Greedy: the argmax of each row's logits.
"""

from __future__ import annotations

import ctypes
import json
import sys
import time

import numpy as np


def main() -> int:
    import llama_cpp as L

    job = json.load(sys.stdin)
    prompts, K = job["prompts"], job["output_len"]
    L.llama_backend_init()
    mp = L.llama_model_default_params()
    model = L.llama_model_load_from_file(job["model"].encode(), mp)
    vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    S = len(prompts)
    total = sum(map(len, prompts))
    cp = L.llama_context_default_params()
    cp.n_ctx = total + S * K + 64
    cp.n_batch = max(total, S)
    cp.n_ubatch = min(cp.n_batch, 512)
    cp.n_seq_max = S
    cp.n_threads = cp.n_threads_batch = job["threads"]
    ctx = L.llama_init_from_model(model, cp)
    batch = L.llama_batch_init(max(total, S), 0, S)

    def put(j, token, pos, seq, logits):
        batch.token[j] = token
        batch.pos[j] = pos
        batch.n_seq_id[j] = 1
        batch.seq_id[j][0] = seq
        batch.logits[j] = logits

    def argmax(j):
        row = L.llama_get_logits_ith(ctx, j)
        return int(np.ctypeslib.as_array(ctypes.cast(row, ctypes.POINTER(ctypes.c_float)),
                                          shape=(vocab,)).argmax())  # fmt: skip

    seconds, first = [], None
    for _ in range(job["repeats"]):
        L.llama_memory_clear(L.llama_get_memory(ctx), True)
        t = time.perf_counter()
        j = 0
        last = []
        for s, p in enumerate(prompts):
            for i, tok in enumerate(p):
                put(j, tok, i, s, i == len(p) - 1)
                j += 1
            last.append(j - 1)
        batch.n_tokens = j
        if L.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed on the prompts")
        out = [[argmax(r)] for r in last]
        for k in range(1, K):
            for s, p in enumerate(prompts):
                put(s, out[s][-1], len(p) + k - 1, s, True)
            batch.n_tokens = S
            if L.llama_decode(ctx, batch) != 0:
                raise RuntimeError(f"llama_decode failed at step {k}")
            for s in range(S):
                out[s].append(argmax(s))
        seconds.append(time.perf_counter() - t)
        first = first or out
    print(json.dumps({"seconds": seconds, "tokens": first, "version": L.__version__}))
    L.llama_batch_free(batch)
    L.llama_free(ctx)
    L.llama_model_free(model)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

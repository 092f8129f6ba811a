"""Regenerates tests/golden/hf: tiny checkpoints written by transformers, with the
prompt logits and greedy tokens transformers computes from them.

The default test suite compares this project's loader and engine against these files, so
it needs neither torch nor transformers; ``pytest -m hf`` (tests/test_hf_parity.py) runs
the same comparison live. Run from the repository root, with transformers and a CPU torch
installed::

    python tests/golden/regenerate_hf.py [VARIANT ...]   # default: every variant

Each variant directory holds ``config.json``, ``model.safetensors`` (bf16 weights, about
40 KB) and ``golden.npz``: ``logits`` (f32[T, V], every position of the "long" prompt,
weights upcast to f32) and ``greedy_<prompt>`` (i32[32]: argmax decoding with
transformers' own KV cache).
"""

from __future__ import annotations

import pathlib
import sys

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent / "hf"
sys.path.insert(0, str(HERE.parents[1]))

from hf_cases import (  # noqa: E402
    COMMON,
    MODEL_CLASSES,
    golden_arrays,
    hf_config,
    randomize,
)

NEW_TOKENS = 32


def main() -> None:
    import torch
    import transformers

    only = set(sys.argv[1:])
    unknown = only - set(MODEL_CLASSES)
    if unknown:
        raise SystemExit(f"unknown variants {sorted(unknown)}; known: {list(MODEL_CLASSES)}")
    for seed, name in enumerate(MODEL_CLASSES):  # (each variant's seed whatever is asked)
        if only and name not in only:
            continue
        torch.manual_seed(seed)
        cfg = hf_config(transformers, name)
        hf = getattr(transformers, MODEL_CLASSES[name])(cfg).eval()
        randomize(hf, name)
        out = HERE / name
        out.mkdir(parents=True, exist_ok=True)
        hf.to(torch.bfloat16).save_pretrained(out)
        # The reference runs on exactly the stored weights, upcast.
        ref = getattr(transformers, MODEL_CLASSES[name]).from_pretrained(out, dtype=torch.float32)
        ref.eval()
        np.savez_compressed(out / "golden.npz", **golden_arrays(ref, NEW_TOKENS))
        size = sum(f.stat().st_size for f in out.iterdir())
        print(f"{name}: {size / 1024:.0f} KB, vocab {COMMON['vocab_size']}")
    # one line a variant: what wrote its files
    versions = HERE / "VERSIONS"
    lines = (
        dict(line.split(": ", 1) for line in versions.read_text().splitlines() if ": " in line)
        if versions.exists()
        else {}
    )
    for name in MODEL_CLASSES:
        if not only or name in only:
            lines[name] = f"transformers {transformers.__version__}, torch {torch.__version__}"
    versions.write_text("".join(f"{n}: {lines[n]}\n" for n in MODEL_CLASSES if n in lines))


if __name__ == "__main__":
    main()

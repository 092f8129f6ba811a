"""Regenerates tests/golden/lora: PEFT LoRA adapters for the tiny Llama checkpoint in
tests/golden/hf/llama, written by peft, with the prompt logits and greedy tokens
transformers + peft compute with each adapter applied.

The default test suite compares this project's adapters against these files, so it needs
neither torch nor peft. Run from the repository root, with transformers, peft and a CPU
torch installed (the ``hf`` extra and torch)::

    python tests/golden/regenerate_lora.py

Each adapter directory holds ``adapter_config.json``, ``adapter_model.safetensors`` (f32,
a few KB) and ``golden.npz``: ``logits`` (f32[T, V], every position of the "long" prompt)
and ``greedy_<prompt>`` (i32[32]). The adapters differ in what a loader must get right:

- ``attn``: rank 4, alpha 8, q/k/v/o (scale alpha / r = 2);
- ``mlp``: rank 8, alpha 4, gate/up/down with rsLoRA (scale alpha / sqrt(r));
- ``all``: rank 2, alpha 16, every projection, only layer 1 (``layers_to_transform``).

LoRA's B starts at zero in peft, which would make every adapter the base model: the
weights here are random (``init_lora_weights=False``), scaled so each adapter changes
the greedy tokens.
"""

from __future__ import annotations

import pathlib
import sys

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from hf_cases import golden_arrays  # noqa: E402

BASE = HERE / "hf" / "llama"
OUT = HERE / "lora"
NEW_TOKENS = 32
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
ADAPTERS = {
    "attn": dict(r=4, lora_alpha=8, target_modules=ATTN),
    "mlp": dict(r=8, lora_alpha=4, target_modules=MLP, use_rslora=True),
    "all": dict(r=2, lora_alpha=16, target_modules=ATTN + MLP, layers_to_transform=[1]),
}


def main() -> None:
    import peft
    import torch
    import transformers

    for seed, (name, kw) in enumerate(ADAPTERS.items()):
        torch.manual_seed(100 + seed)
        base = transformers.LlamaForCausalLM.from_pretrained(BASE, dtype=torch.float32).eval()
        config = peft.LoraConfig(init_lora_weights=False, lora_dropout=0.0, bias="none", **kw)
        model = peft.get_peft_model(base, config)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_" in n:
                    p.copy_(torch.randn_like(p) * 0.3)
        out = OUT / name
        out.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out)
        (out / "README.md").unlink(missing_ok=True)  # peft's model card template
        # The reference: the saved adapter, loaded back onto the stored base weights.
        fresh = transformers.LlamaForCausalLM.from_pretrained(BASE, dtype=torch.float32)
        ref = peft.PeftModel.from_pretrained(fresh, out).eval()
        np.savez_compressed(out / "golden.npz", **golden_arrays(ref, NEW_TOKENS))
        size = sum(f.stat().st_size for f in out.iterdir())
        print(f"{name}: {size / 1024:.0f} KB")
    (OUT / "VERSIONS").write_text(
        f"transformers {transformers.__version__}\npeft {peft.__version__}\n"
        f"torch {torch.__version__}\n"
    )


if __name__ == "__main__":
    main()

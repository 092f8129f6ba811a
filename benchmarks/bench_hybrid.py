"""KV memory of one long sequence on a hybrid pool against a pool of whole-model pages.

``python -m benchmarks hybrid [--context 32768] [--page-size 16] [--chunk 512]``

Host only (no model runs): the real ``HybridBlockManager`` with each model's real layer
pattern (``paged_jax.layer_groups``) takes a prompt of ``--context`` tokens, computes it
in chunks of ``--chunk`` tokens (as the engine's chunked prefill marks them), then
decodes 16 tokens. Reported per sequence, in bf16: the bytes a pool of whole-model pages
holds (every layer keeps every page), the hybrid pool's bytes at admission (every group
takes the prompt's pages until they are computed: the peak), after the prefill, and
after decoding (steady state: a sliding group keeps about a window of pages).
"""

from __future__ import annotations

import argparse

from benchmarks.common import environment, positive_int, table, write_result
from paged_jax.block_manager import HybridBlockManager, layer_groups


def gemma3(layers: int, window: int) -> list[int | None]:
    """Gemma 3: five sliding layers, then a global one."""
    return [None if (i + 1) % 6 == 0 else window for i in range(layers)]


def gemma2(layers: int, window: int) -> list[int | None]:
    """Gemma 2: sliding and global layers alternate, sliding first."""
    return [window if i % 2 == 0 else None for i in range(layers)]


# name: (layer windows, KV heads, head dim), from the models' config.json files
MODELS = {
    "gemma-2-9b": (gemma2(42, 4096), 8, 256),
    "gemma-3-1b": (gemma3(26, 512), 1, 256),
    "gemma-3-4b": (gemma3(34, 1024), 4, 256),
    "gemma-3-12b": (gemma3(48, 1024), 8, 256),
    "gemma-3-27b": (gemma3(62, 1024), 16, 128),
}
BYTES = 2  # bf16


def measure(windows, kv_heads: int, head_dim: int, context: int, page: int, chunk: int):
    """Bytes of one sequence: whole-model pages, and the hybrid pool at admission, after
    the prefill and after 16 decode steps."""
    group_windows, _, slot = layer_groups(windows)
    k = max(slot) + 1  # layer slots of a hybrid page
    slot_bytes = page * 2 * kv_heads * head_dim * BYTES  # one layer slot of one page
    pages = -(-(context + 16) // page)
    bm = HybridBlockManager(
        len(group_windows) * pages + 1,
        page,
        group_windows=group_windows,
        enable_prefix_caching=False,
        watermark=0.0,
    )
    prompt = [1] * context

    def used() -> int:
        return (bm.num_pages - 1 - bm.num_free_pages) * k * slot_bytes

    bm.allocate("s", prompt)
    admission = used()
    for stop in range(chunk, context + chunk, chunk):
        bm.mark_computed("s", min(stop, context))
    prefilled = used()
    for _ in range(16):
        bm.append_slots("s", [1])
        bm.take_copies()
    bm.mark_computed("s", bm.num_tokens("s"))
    bm.check_invariants()
    plain = -(-bm.num_tokens("s") // page) * len(windows) * slot_bytes
    return dict(
        layers=len(windows),
        sliding=sum(w is not None for w in windows),
        groups=len(group_windows),
        slots_per_page=k,
        whole_model_pages=plain,
        hybrid_admission=admission,
        hybrid_after_prefill=prefilled,
        hybrid_decoding=used(),
        saving=1 - used() / plain,
    )


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks hybrid", description=__doc__)
    ap.add_argument("--context", type=positive_int, default=32768)
    ap.add_argument("--page-size", type=positive_int, default=16)
    ap.add_argument("--chunk", type=positive_int, default=512)
    args = ap.parse_args(argv)
    rows = []
    for name, (windows, kv_heads, head_dim) in MODELS.items():
        r = measure(windows, kv_heads, head_dim, args.context, args.page_size, args.chunk)
        rows.append(dict(model=name, **r))
    gib = 2.0**30
    shown = [
        {
            "model": r["model"],
            "layers (sliding)": f"{r['layers']} ({r['sliding']})",
            "groups x slots": f"{r['groups']} x {r['slots_per_page']}",
            "whole-model pages": f"{r['whole_model_pages'] / gib:.2f} GiB",
            "hybrid, admission": f"{r['hybrid_admission'] / gib:.2f} GiB",
            "hybrid, decoding": f"{r['hybrid_decoding'] / gib:.2f} GiB",
            "saving": f"{100 * r['saving']:.0f}%",
        }
        for r in rows
    ]
    print(f"one sequence of {args.context} + 16 tokens, pages of {args.page_size}, bf16")
    print(table(shown, list(shown[0])))
    write_result(
        "hybrid",
        dict(
            environment=environment(),
            command="python -m benchmarks hybrid " + " ".join(argv),
            context=args.context,
            page_size=args.page_size,
            chunk=args.chunk,
            rows=rows,
        ),
    )
    return 0

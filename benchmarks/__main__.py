"""``python -m benchmarks <name> [--out DIR] [args]``: memory, sharing, throughput,
host_overhead, kernels, engine, block_manager, layer_view, peers, serve, hybrid, sampler,
serve_vllm_client, quantization, grammar, speculative, dispatch, products, lora,
structured, draw, lm_eval, step_kernels, moe, gguf, fleet.
``--out DIR``
writes the results there; without it they go to a new ``bench-results/<time>`` directory
under the current one. The committed results in ``benchmarks/results`` change only with
``--out benchmarks/results``."""

import importlib
import sys

from benchmarks.common import take_out_arg
from paged_jax.cli.flags import BENCHMARKS

NAMES = BENCHMARKS  # (paged-jax bench takes the same names)

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in NAMES:
        print(
            f"usage: python -m benchmarks {{{','.join(NAMES)}}} [--out DIR] [args]",
            file=sys.stderr,
        )
        raise SystemExit(2)
    try:
        args = take_out_arg(sys.argv[2:])
    except ValueError as e:
        print(e, file=sys.stderr)
        raise SystemExit(2) from None
    mod = importlib.import_module(f"benchmarks.bench_{sys.argv[1]}")
    raise SystemExit(mod.main(args))

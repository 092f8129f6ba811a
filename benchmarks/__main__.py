"""``python -m benchmarks <name> [--out DIR] [args]``: memory, sharing, throughput,
host_overhead, kernels, engine, block_manager, layer_view. ``--out DIR`` writes the results there
instead of ``benchmarks/results`` (the committed ones)."""

import importlib
import os
import sys

from benchmarks.common import OUT_ENV

NAMES = (
    "memory",
    "sharing",
    "throughput",
    "host_overhead",
    "kernels",
    "engine",
    "block_manager",
    "layer_view",
)

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in NAMES:
        print(
            f"usage: python -m benchmarks {{{','.join(NAMES)}}} [--out DIR] [args]",
            file=sys.stderr,
        )
        raise SystemExit(2)
    args = sys.argv[2:]
    if "--out" in args:
        i = args.index("--out")
        if i + 1 >= len(args):
            print("--out: expected a directory", file=sys.stderr)
            raise SystemExit(2)
        os.environ[OUT_ENV] = args[i + 1]
        del args[i : i + 2]
    mod = importlib.import_module(f"benchmarks.bench_{sys.argv[1]}")
    raise SystemExit(mod.main(args))

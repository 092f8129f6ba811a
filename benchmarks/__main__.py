"""``python -m benchmarks <name> [args]``: memory, sharing, throughput, host_overhead,
kernels, block_manager."""

import importlib
import sys

NAMES = ("memory", "sharing", "throughput", "host_overhead", "kernels", "block_manager")

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in NAMES:
        print(f"usage: python -m benchmarks {{{','.join(NAMES)}}} [args]", file=sys.stderr)
        raise SystemExit(2)
    mod = importlib.import_module(f"benchmarks.bench_{sys.argv[1]}")
    raise SystemExit(mod.main(sys.argv[2:]))

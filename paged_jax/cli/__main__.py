"""``python -m paged_jax.cli``: the console script."""

from paged_jax.cli import run

run()

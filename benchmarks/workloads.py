"""Synthetic request-length workloads shaped like the PagedAttention paper's datasets.

Means from the paper's Fig. 11 histograms, as this project recalls them (they could not be
re-checked against the paper on this machine; they agree with its text, which says
ShareGPT has 8.4x longer prompts and 5.8x longer outputs than Alpaca on average):
ShareGPT: prompt 161.3, output 338.0 tokens; Alpaca: prompt 19.3, output 58.5 tokens.
Shape (this project's assumption): log-normal with sigma 1.0 (ShareGPT, long-tailed) and
0.6 (Alpaca), rescaled to hit the means after clipping to [1, max_len] in total.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    prompt_mean: float
    output_mean: float
    sigma: float


WORKLOADS = {
    "sharegpt": Workload("sharegpt", 161.3, 338.0, 1.0),
    "alpaca": Workload("alpaca", 19.3, 58.5, 0.6),
}


def _lognormal(rng, mean, sigma, n):
    mu = np.log(mean) - sigma**2 / 2  # E[exp(N(mu, sigma))] = mean
    return rng.lognormal(mu, sigma, n)


def sample_lengths(
    workload: str, n: int, *, seed: int = 0, max_len: int = 2048, scale: float = 1.0
) -> list[tuple[int, int]]:
    """``n`` (prompt_len, output_len) pairs, each total <= max_len; ``scale`` shrinks both."""
    w = WORKLOADS[workload]
    rng = np.random.default_rng(seed)
    p = np.maximum(1, np.round(_lognormal(rng, w.prompt_mean * scale, w.sigma, n))).astype(int)
    o = np.maximum(1, np.round(_lognormal(rng, w.output_mean * scale, w.sigma, n))).astype(int)
    p = np.minimum(p, max_len - 1)
    o = np.minimum(o, max_len - p)
    return list(zip(p.tolist(), o.tolist(), strict=True))

"""Speculative decoding (``LLM(speculative=...)``).

A decoding sequence whose proposer finds a continuation computes it as extra query
tokens of the same ragged step: its input is its last sampled token and the ``k``
proposed tokens, and the step samples ``k + 1`` tokens, one from each position's logits,
with the request's own sampling parameters and the seed and output position each token
would have had without speculation. Token ``j`` is kept while every proposal before it
equals the sample before it, so the tokens kept are exactly those the engine samples
without speculation, greedy or seeded (see ``verifier``).

Modules: ``config`` (``SpeculativeConfig``), ``proposers`` (what the engine asks of a
proposer, and prompt lookup), ``draft`` (a draft model as the proposer), ``verifier``
(the engine core's ``Speculator``: proposals in a step, verify rows, acceptance).
"""

from paged_jax.engine.speculative.config import METHODS, SpeculativeConfig
from paged_jax.engine.speculative.proposers import (
    DraftRequest,
    NgramProposer,
    Proposer,
    lookup,
)
from paged_jax.engine.speculative.verifier import CONFIDENT, Speculator, accept, num_verify_rows

__all__ = [
    "CONFIDENT",
    "METHODS",
    "DraftRequest",
    "NgramProposer",
    "Proposer",
    "SpeculativeConfig",
    "Speculator",
    "accept",
    "lookup",
    "num_verify_rows",
]

"""Speculative decoding (``LLM(speculative=...)``).

Proposed tokens are computed as extra query tokens of the same ragged step and kept
while each equals what the engine would have sampled there without speculation, so the
output is the same, greedy or seeded (``verifier``'s docstring has the details).

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

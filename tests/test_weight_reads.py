"""Each weight read once per decode step: XLA's cost analysis of the compiled step.

Decoding is bound by reading the weights. A ``lax.scan`` over stacked ``[L, ...]``
weights made XLA copy each layer's slices before multiplying, every step (2.5x the weight
bytes on an H100); ``hold_for_accelerator`` (what the engine does off the CPU) holds
them per layer and unrolls the loop. These tests compile the decode step on the CPU
from shapes alone, for SmolLM2-135M's and Llama-3-8B's configs, and read the bytes the
analysis charges per byte of layer weights (``benchmarks.engine_roofline.weight_reads``
says how the double difference cancels what is not a weight read). f32: XLA:CPU turns
bf16 products into f32 ones with converted copies of the weights, which an accelerator
does not.
"""

import jax
import pytest

from benchmarks.engine_roofline import SHAPE_FIELDS, weight_reads


def _on_cpu(**kw):
    """``weight_reads`` compiled by XLA:CPU on any machine (XLA:GPU's cost analysis charges
    other things: see docs/ENGINE.md)."""
    with jax.default_device(jax.devices("cpu")[0]):
        return weight_reads(**kw)["bytes_per_weight_byte"]


@pytest.mark.parametrize("name", ["smollm2-135m", "llama3-8b"])
def test_decode_step_reads_each_layer_weight_once(name):
    r = _on_cpu(fields=SHAPE_FIELDS[name])
    # measured 1.047 (SmolLM2: its activations and attention are larger next to its small
    # weights) and 1.006 (Llama-3-8B) with jax 0.10.2
    assert 0.9 <= r <= 1.15, r


def _stacked_slices(model):
    model.unrolled = True  # the unrolled loop, but each layer's weights sliced from a stack
    return model


@pytest.mark.parametrize(
    "hold, expected",
    [(_stacked_slices, "copies"), (lambda model: model, "loop")],
    ids=["unrolled-stacked", "scanned"],
)
def test_weight_reads_sees_copies_and_loops(hold, expected):
    # The measure can fail: slices of a stack are copied before their products (about 3
    # reads a weight byte), and a scan's body is charged once whatever the depth.
    r = _on_cpu(fields=SHAPE_FIELDS["smollm2-135m"], hold=hold)
    assert r > 2.0 if expected == "copies" else r < 0.5, r

"""Live parity with Hugging Face transformers (``pytest -m hf``; needs transformers and
a CPU torch: ``pip install transformers torch --index-url https://download.pytorch.org/whl/cpu``).

The default suite checks the same things against golden files (tests/test_hf_golden.py);
this runs transformers itself on freshly built variants, in f32, and checks the golden
files are what the installed transformers computes.
"""

import pathlib

import jax.numpy as jnp
import numpy as np
import pytest
from hf_cases import MODEL_CLASSES, MOE, PROMPTS, hf_config, hf_greedy, randomize, router_choices
from model_helpers import greedy_batch_fork_and_prefix_hit, paged_prompt_logits

from paged_jax.models import load_hf

pytestmark = pytest.mark.hf
GOLDEN = pathlib.Path(__file__).resolve().parent / "golden" / "hf"
BATCH = ("short", "mid", "long")


@pytest.fixture(scope="module")
def libs():
    """(transformers, torch), imported only when an hf test runs (a module-level import
    would report a skip on every default run, where these tests are deselected)."""
    return (
        pytest.importorskip("transformers", reason="pytest -m hf needs transformers"),
        pytest.importorskip("torch", reason="pytest -m hf needs torch (a CPU build)"),
    )


def _built(name, tmp_path_factory, libs):
    """(transformers' model of variant ``name``, ours loaded from its saved checkpoint)."""
    transformers, torch = libs
    torch.manual_seed(100)
    cfg = hf_config(transformers, name)
    hf = getattr(transformers, MODEL_CLASSES[name])(cfg).eval()
    randomize(hf, name)
    path = tmp_path_factory.mktemp(name)
    hf.save_pretrained(path)
    model, _ = load_hf(path, dtype=jnp.float32)
    return hf, model


@pytest.fixture(scope="module", params=list(MODEL_CLASSES))
def pair(request, tmp_path_factory, libs):
    return request.param, *_built(request.param, tmp_path_factory, libs)


def test_prompt_logits_match(pair, libs):
    torch = libs[1]
    name, hf, model = pair
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPTS["long"]])).logits[0].numpy()
    rel = np.abs(paged_prompt_logits(model, PROMPTS["long"]) - ref).max() / np.abs(ref).max()
    assert rel <= 1e-4, f"{name}: relative error {rel:.2e}"


def test_greedy_batch_fork_and_prefix_match_transformers(pair):
    name, hf, model = pair
    out, computed = greedy_batch_fork_and_prefix_hit(model, PROMPTS, BATCH, "hit")
    for k in (*BATCH, "hit"):
        assert out[k] == hf_greedy(hf, PROMPTS[k], 32), f"{name}/{k}"
    assert out["twin"] == out["mid"], f"{name}/twin"
    assert computed == 3, "the pages shared with 'mid' were prefilled again"


@pytest.mark.parametrize("name", MOE)
def test_routers_choose_as_transformers_does(name, tmp_path_factory, libs):
    hf, model = _built(name, tmp_path_factory, libs)
    inputs, chosen = router_choices(hf, PROMPTS["long"])
    for i in range(model.config.num_layers):
        _, ids = model.layer(i).mlp.choices(jnp.asarray(inputs[i]))
        np.testing.assert_array_equal(np.asarray(ids), chosen[i], err_msg=f"{name} layer {i}")


@pytest.mark.parametrize("name", list(MODEL_CLASSES))
def test_golden_files_are_what_transformers_computes(name, libs):
    """The committed golden files still hold for the installed transformers."""
    transformers, torch = libs
    path = GOLDEN / name
    ref = getattr(transformers, MODEL_CLASSES[name]).from_pretrained(path, dtype=torch.float32)
    golden = np.load(path / "golden.npz")
    with torch.no_grad():
        logits = ref.eval()(torch.tensor([PROMPTS["long"]])).logits[0].numpy()
    np.testing.assert_allclose(logits, golden["logits"], rtol=0, atol=1e-5)
    for key, prompt in PROMPTS.items():
        assert hf_greedy(ref, prompt, 32) == golden[f"greedy_{key}"].tolist(), f"{name}/{key}"

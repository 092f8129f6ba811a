"""Chat templates rendered as transformers' apply_chat_template renders them (golden strings
in tests/golden/chat.json; tests/golden/regenerate_chat.py regenerates them), the
tokenizers that carry them, and LLM.chat."""

import json
import pathlib

import pytest
from test_gguf import TEMPLATE, _model, write_gguf

import paged_jax as pj
from paged_jax import models
from paged_jax.chat import ChatTemplateError, render_chat
from paged_jax.models import load_gguf, load_hf
from paged_jax.models.hf import to_hf_tensors

GOLDEN = json.loads(
    (pathlib.Path(__file__).resolve().parent / "golden" / "chat.json").read_text("utf-8")
)


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_rendered_prompts_equal_transformers(name):
    case = GOLDEN[name]
    assert len(case["cases"]) == 8
    for c in case["cases"]:
        got = render_chat(
            case["template"],
            c["messages"],
            add_generation_prompt=c["add_generation_prompt"],
            special_tokens=case["special_tokens"],
        )
        assert got == c["rendered"], (name, c["messages"], c["add_generation_prompt"])


def test_bad_conversations_and_templates_are_named():
    t = GOLDEN["helpers"]["template"]
    special = GOLDEN["helpers"]["special_tokens"]
    with pytest.raises(ValueError, match=r"messages\[1\]: expected a string 'content', got 3"):
        render_chat(t, [{"role": "user", "content": "a"}, {"role": "user", "content": 3}])
    with pytest.raises(TypeError, match=r"messages\[0\]: expected a mapping, got str"):
        render_chat(t, ["hi"])
    with pytest.raises(ValueError, match="expected at least one message"):
        render_chat(t, [])
    with pytest.raises(ChatTemplateError, match="unknown role tool"):
        render_chat(t, [{"role": "tool", "content": "x"}], special_tokens=special)
    with pytest.raises(ChatTemplateError, match="line 1"):
        render_chat("{% for m in messages %}", [{"role": "user", "content": "x"}])
    # the sandbox: no reaching into Python internals from a template
    with pytest.raises(ChatTemplateError):
        render_chat("{{ messages.__class__.__mro__ }}", [{"role": "user", "content": "x"}])


HOSTILE = {
    "nested loops": "{% for i in range(100000) %}{% for j in range(100000) %}"
    "{% endfor %}{% endfor %}",
    "repetition": "{{ 'a' * 1000000000 }}",
    "doubling ~": "{% set ns = namespace(x='ab') %}{% for i in range(40) %}"
    "{% set ns.x = ns.x ~ ns.x %}{% endfor %}{{ ns.x }}",
    "doubling +": "{% set ns = namespace(x='ab') %}{% for i in range(40) %}"
    "{% set ns.x = ns.x + ns.x %}{% endfor %}{{ ns.x }}",
    "method width": "{{ 'a'.ljust(1000000000) }}",
    "filter width": "{{ 'a'|indent(1000000000, true) }}",
    "format width": "{{ '{:>100000000}'.format('a') }}",
    "percent width": "{{ '%100000000s' % 'a' }}",
    "power": "{{ 10 ** 100000000 }}",
    "long output": "{% for i in range(100000) %}{{ 'x' * 100 }}{% endfor %}",
    "division": "{{ 1 / 0 }}",
    "recursion": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "mutation": "{{ messages.append(1) }}",
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_templates_fail_fast_as_chat_template_errors(name, monkeypatch):
    # Templates come from model files: each one is stopped by a bound of time or size (or
    # fails on its own) and every failure is a ChatTemplateError (the server's 400).
    import time

    from paged_jax import chat

    monkeypatch.setattr(chat, "MAX_RENDER_SECONDS", 0.3)
    t0 = time.monotonic()
    with pytest.raises(ChatTemplateError, match="chat template: "):
        render_chat(HOSTILE[name], [{"role": "user", "content": "hi"}])
    assert time.monotonic() - t0 < 3.0
    # the sandbox still renders ordinary templates, with formats and string methods
    ok = "{{ '%s: %5.1f'|format(messages[0].role, 2.5) }} {{ '{:>4}'.format('x') ~ 'y'.ljust(3) }}"
    assert render_chat(ok, [{"role": "user", "content": "hi"}]) == "user:   2.5    xy  "


def test_checkpoint_and_gguf_tokenizers_carry_their_template(tmp_path):
    model = _model()
    write_gguf(tmp_path / "m.gguf", model)
    _, tok = load_gguf(tmp_path / "m.gguf")
    conv = [{"role": "user", "content": "hello world"}]
    assert tok.apply_chat_template(conv) == "<|user|>hello world"
    assert (
        tok.apply_chat_template(conv, tokenize=True)
        == tok.encode("<|user|>hello world", add_special_tokens=False).ids
    )
    assert tok.special_tokens == {"bos_token": "<s>", "eos_token": "</s>"}
    # a Hugging Face directory: tokenizer.json + tokenizer_config.json's template
    from safetensors.numpy import save_file

    d = tmp_path / "hf"
    d.mkdir()
    save_file(to_hf_tensors(model), str(d / "model.safetensors"))
    c = model.config
    (d / "config.json").write_text(
        json.dumps(
            dict(
                architectures=["LlamaForCausalLM"],
                vocab_size=c.vocab_size,
                hidden_size=c.hidden_size,
                intermediate_size=c.intermediate_size,
                num_hidden_layers=c.num_layers,
                num_attention_heads=c.num_heads,
                num_key_value_heads=c.num_kv_heads,
                head_dim=c.head_dim,
            )
        )
    )
    tok.tokenizer.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": GOLDEN["llama3"]["template"], "bos_token": {"content": "<s>"}})
    )
    _, hf_tok = load_hf(d)
    assert hf_tok.apply_chat_template(conv, add_generation_prompt=False) == (
        "<s><|start_header_id|>user<|end_header_id|>\n\nhello world<|eot_id|>"
    )
    (d / "chat_template.jinja").write_text(TEMPLATE)  # the newer file wins
    assert load_hf(d)[1].apply_chat_template(conv) == "<|user|>hello world"


def test_llm_chat_is_generate_on_the_rendered_prompt_and_reuses_pages(tmp_path):
    write_gguf(tmp_path / "m.gguf", _model())
    model, tok = load_gguf(tmp_path / "m.gguf")
    llm = pj.LLM(model, tok, num_pages=64, page_size=16, max_num_seqs=8)
    p = pj.SamplingParams(max_tokens=6, ignore_eos=True)
    first = [{"role": "user", "content": "hello world " * 12}]
    out = llm.chat(first, p, progress=False)
    assert len(out) == 1
    ids = tok.apply_chat_template(first, tokenize=True)
    assert out[0].prompt_token_ids == ids
    again = pj.LLM(model, tok, num_pages=64, page_size=16).generate([ids], p, progress=False)
    assert out[0].outputs[0].token_ids == again[0].outputs[0].token_ids
    # the next turn starts with the first turn's text: its full pages come from the cache
    reply = out[0].outputs[0].text
    second = [*first, {"role": "assistant", "content": reply}, {"role": "user", "content": "ok"}]
    outs = llm.chat([second, first], p, progress=False)
    assert len(outs) == 2
    assert len(ids) >= 32 and outs[0].metrics.num_cached_tokens >= 16
    with pytest.raises(ValueError, match=r"conversations\[1\]: messages\[0\]: expected a string"):
        llm.chat([first, [{"role": "user"}]], p, progress=False)
    tiny = pj.LLM(*models.load("tiny-llama"), num_pages=16)
    with pytest.raises(ValueError, match="tokenizer: chat needs a tokenizer with a chat template"):
        tiny.chat(first, p)


def test_continue_final_message_goes_on_with_the_assistants_words(tmp_path):
    """``continue_final_message`` (vLLM's and transformers'): the prompt ends with the
    final assistant message's text, not with its end-of-turn; in ``LLM.chat`` and the
    server alike. Refused without a final assistant message, with a template that does
    not write it, and beside ``add_generation_prompt``."""
    from starlette.testclient import TestClient

    from paged_jax.chat import cut_after_final_message
    from paged_jax.server.api import Server

    template = GOLDEN["smollm2"]["template"]  # ChatML: <|im_start|>role\n...<|im_end|>
    msgs = [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "It is "}]
    text = render_chat(template, msgs, add_generation_prompt=False)
    cut = cut_after_final_message(text, msgs)
    assert text.endswith("It is <|im_end|>\n") and cut == text[: text.rindex("It is ") + 6]
    assert cut.endswith("<|im_start|>assistant\nIt is ")
    with pytest.raises(ValueError, match="needs a final assistant message with text"):
        cut_after_final_message(text, msgs[:1])
    with pytest.raises(ValueError, match="does not write the final message's content"):
        cut_after_final_message("<|im_start|>assistant\n", msgs)

    write_gguf(tmp_path / "m.gguf", _model(), extra={"tokenizer.chat_template": template})
    model, tok = load_gguf(tmp_path / "m.gguf")
    llm = pj.LLM(model, tok, num_pages=64, page_size=16, compilation_cache=False)
    p = pj.SamplingParams(max_tokens=3, ignore_eos=True)
    out = llm.chat(msgs, p, add_generation_prompt=False, continue_final_message=True,
                   progress=False)  # fmt: skip
    want = tok.encode(cut, add_special_tokens=False).ids
    assert out[0].prompt_token_ids == want
    with pytest.raises(ValueError, match="continue_final_message: not with add_generation"):
        llm.chat(msgs, p, continue_final_message=True)
    body = dict(model="t", messages=msgs, max_tokens=3, continue_final_message=True)
    with TestClient(Server(llm, model_name="t").app) as http:
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(want)
        r = http.post("/v1/chat/completions", json=body | {"add_generation_prompt": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"
        r = http.post("/v1/chat/completions", json=body | {"messages": msgs[:1]})
        assert r.status_code == 400 and "final assistant message" in r.text

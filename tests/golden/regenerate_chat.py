"""Regenerates tests/golden/chat.json: conversations rendered by transformers'
``apply_chat_template`` under SmolLM2's chat template (from its GGUF), Llama 3's and
Qwen2's, and one that uses the environment's helpers. Needs transformers and gguf.

    python tests/golden/regenerate_chat.py [--smollm2-gguf PATH]
"""

import argparse
import json
import pathlib

OUT = pathlib.Path(__file__).resolve().parent / "chat.json"

LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | "
    "trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
    "{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>"
    "assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
QWEN2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# whitespace control, loop controls, tojson, a namespace, the generation block
HELPERS = """{%- set ns = namespace(turns=0) %}
{%- for m in messages %}
    {%- if m.role not in ['system', 'user', 'assistant'] %}
        {{- raise_exception('unknown role ' + m.role) }}
    {%- endif %}
    {%- if m.role == 'system' %}
        {{- '[SYS] ' + m.content | tojson + '\\n' }}
        {%- continue %}
    {%- endif %}
    {%- set ns.turns = ns.turns + 1 %}
    {%- if m.role == 'assistant' %}
        {%- generation %}
        {{- '<bot> ' + m.content + eos_token + '\\n' }}
        {%- endgeneration %}
    {%- else %}
        {{- '<user ' ~ ns.turns ~ '> ' + m.content + '\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<bot> ' }}{% endif %}"""

CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
    ],
    [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi! How can I help?"},
        {"role": "user", "content": "Tell me a joke about JAX."},
    ],
    [
        {"role": "user", "content": 'Unicode: 日本語 😀 "quoted" ümlaut'},
        {"role": "assistant", "content": "  spaced  "},
        {"role": "user", "content": "ok\n"},
    ],
]


def main() -> int:
    import gguf
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smollm2-gguf", default=None, help="default: paged_jax.models.fetch")
    args = ap.parse_args()
    path = args.smollm2_gguf
    if path is None:
        from paged_jax.models import fetch

        path = fetch("smollm2-135m-instruct")
    smol = gguf.GGUFReader(path).fields["tokenizer.chat_template"].contents()
    templates = {
        "smollm2": (smol, {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}),
        "llama3": (LLAMA3, {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}),
        "qwen2": (QWEN2, {"eos_token": "<|im_end|>"}),
        "helpers": (HELPERS, {"bos_token": "<s>", "eos_token": "</s>"}),
    }
    out = {}
    for name, (template, special) in templates.items():
        tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()), **special)
        tok.chat_template = template
        cases = []
        for conv in CONVERSATIONS:
            for gen in (True, False):
                text = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen)
                cases.append({"messages": conv, "add_generation_prompt": gen, "rendered": text})
        out[name] = {"template": template, "special_tokens": special, "cases": cases}
    OUT.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

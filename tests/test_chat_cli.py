"""``paged-jax chat`` driven through a pseudo-terminal, and ``generate --chat``."""

import json
import os
import pty
import select
import subprocess
import sys
import time

import pytest
from test_gguf import _model, write_gguf

from paged_jax.models import load_gguf

CLI = [sys.executable, "-m", "paged_jax.cli"]


class Terminal:
    """The parent's side of a pseudo-terminal: ``expect`` waits for text."""

    def __init__(self, fd: int):
        self.fd, self.text, self.pos = fd, "", 0

    def expect(self, marker: str, timeout: float = 180.0) -> str:
        """The output from the last match through ``marker``."""
        end = time.monotonic() + timeout
        while marker not in self.text[self.pos :]:
            left = end - time.monotonic()
            assert left > 0, f"no {marker!r} in {timeout} s; output so far {self.text!r}"
            if select.select([self.fd], [], [], left)[0]:
                try:
                    chunk = os.read(self.fd, 4096)
                except OSError:  # the child closed its terminal
                    chunk = b""
                assert chunk, f"the CLI ended before {marker!r}: {self.text!r}"
                self.text += chunk.decode("utf-8", "replace")
        i = self.text.index(marker, self.pos) + len(marker)
        seen, self.pos = self.text[self.pos : i], i
        return seen

    def send(self, line: str) -> None:
        os.write(self.fd, (line + "\n").encode())


def test_interactive_chat_streams_and_reuses_the_conversation(tmp_path):
    write_gguf(tmp_path / "m.gguf", _model())
    args = ["chat", "--model", str(tmp_path / "m.gguf"), "--max-tokens", "8"]
    # the CLI on a pseudo-terminal (subprocess starts it without a Python-level fork,
    # which JAX's threads make unsafe)
    fd, tty = pty.openpty()
    proc = subprocess.Popen(
        [*CLI, *args],
        stdin=tty,
        stdout=tty,
        stderr=tty,
        start_new_session=True,
    )
    os.close(tty)
    term = Terminal(fd)
    try:
        term.expect("> ")
        term.send("hello world " * 4)
        first = term.expect("prompt tokens reused]")
        assert "[8 tokens; prefix cache: 0 of" in first
        term.expect("> ")
        term.send("and again")
        second = term.expect("prompt tokens reused]")
        # the second turn's prompt begins with the first turn: its full pages are reused
        cached = int(second.split("prefix cache: ")[1].split(" ")[0])
        assert cached >= 16, second
        term.expect("> ")
        term.send("")  # an empty line ends the chat
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
        proc.wait()
        os.close(fd)


@pytest.mark.slow  # 19 s (two CLI runs); .ci/run runs it
def test_generate_chat_is_generate_on_the_rendered_prompt(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(path, _model())
    _, tok = load_gguf(path)
    ids = tok.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=True)
    common = ["--model", str(path), "--max-tokens", "4", "--ignore-eos", "--json"]

    def tokens(*extra):
        done = subprocess.run(
            [*CLI, "generate", *common, *extra], capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)["outputs"][0]["completions"][0]["token_ids"]

    chat = tokens("--prompt", "hello", "--chat")
    assert len(chat) == 4
    assert chat == tokens("--prompt-ids", ",".join(map(str, ids)))
    tiny = subprocess.run(
        [*CLI, "generate", "--model", "tiny-llama", "--chat"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert tiny.returncode == 2 and "--chat: tiny-llama has no chat template" in tiny.stderr


@pytest.mark.parametrize("hide", [False, True])
def test_chat_keeps_a_reasoning_models_thinking_apart(tmp_path, monkeypatch, capsys, hide):
    """A template with ``<think>``: the reply's thinking goes dim to stderr (or nowhere
    with ``--hide-thinking``), the answer to stdout, and the next turn's prompt holds
    the answer alone. The engine's stream is scripted (a random model never closes a
    block), cut mid-tag."""
    from types import SimpleNamespace

    import paged_jax.engine.llm as engine_llm
    from paged_jax import cli

    template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
        "<|assistant|><think>\n"
    )
    path = tmp_path / "m.gguf"
    write_gguf(path, _model(), extra={"tokenizer.chat_template": template})
    pieces = ["Let me ", "think.</th", "ink>\n\nIt is", " 4."]
    prompts = []

    def scripted(self, batch, params, lora=None):
        prompts.append(self.decode(batch[0]))
        metrics = SimpleNamespace(num_generated_tokens=4, num_cached_tokens=0, num_prompt_tokens=9)
        done = SimpleNamespace(metrics=metrics)
        for k, text in enumerate(pieces):
            yield SimpleNamespace(text=text, output=done if k == len(pieces) - 1 else None)

    monkeypatch.setattr(engine_llm.LLM, "stream", scripted)
    lines = iter(["2 + 2?", "and 3 + 3?", ""])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    argv = ["chat", "--model", str(path), "--no-warm-up", "--compilation-cache", "off"]
    assert cli.main(argv + (["--hide-thinking"] if hide else [])) == 0
    out, err = capsys.readouterr()
    assert out == "It is 4.\nIt is 4.\n"
    assert ("Let me think." in err) != hide and "</think>" not in err
    assert "<|assistant|>It is 4.<|user|>and 3 + 3?<|assistant|>" in prompts[1]
    assert "think." not in prompts[1]

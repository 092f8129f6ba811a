"""The README and docs: every Python block runs, the worked example prints what it says,
the set-up commands are the ones CI runs, and the demo passes its own check."""

import contextlib
import io
import pathlib
import re

import pytest

import paged_jax.demo

ROOT = pathlib.Path(__file__).resolve().parents[1]


DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _setup_section() -> str:
    text = (ROOT / "README.md").read_text()
    return text[text.index("## Set-up") : text.index("## Quickstart")]


def test_worked_example_runs_as_printed():
    text = (ROOT / "docs" / "ATTENTION.md").read_text()
    section = text[text.index("## A worked example") :]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "docs/ATTENTION.md", "exec"), {})
    assert out.getvalue().strip() == "(20, 8, 64)"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_python_block_of_the_docs_runs(doc):
    blocks = re.findall(r"```python\n(.*?)```", doc.read_text(), re.S)
    for k, code in enumerate(blocks):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(code, f"{doc.name} block {k}", "exec"), {})


def test_docs_hold_python_blocks_and_links_resolve():
    blocks = {d.name: d.read_text().count("```python") for d in DOCS}
    assert blocks["README.md"] == 1 and sum(blocks.values()) >= 6, blocks
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", doc.read_text()):
            assert (doc.parent / target).exists(), f"{doc.name}: broken link {target}"


def test_readme_quickstart_prints_what_it_generated():
    text = (ROOT / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", text[text.index("## Quickstart") :], re.S).group(1)
    assert len(code.strip().splitlines()) <= 15
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md quickstart", "exec"), {})
    lines = out.getvalue().strip().split("\n")
    assert len(lines) == 5 and lines[4] == "True", lines
    for line in lines[:4]:  # 2 prompts x 2 samples; a sample may end early on EOS
        n, reason = line.split()
        assert (reason, n) == ("length", "16") or (reason == "stop" and 1 <= int(n) < 16), line


def test_readme_has_exactly_two_setup_commands_and_ci_runs_the_second():
    setup = _setup_section()
    commands = re.findall(r"```bash\n(.*?)\n```", setup, re.S)
    assert len(commands) == 2
    assert commands[1] in (ROOT / ".ci" / "run").read_text()


def test_readme_demo_command_is_the_cli():
    first = re.findall(r"```bash\n(.*?)\n```", _setup_section(), re.S)[0]
    assert first.endswith(
        "paged-jax generate --model smollm2-135m-instruct -n 2 --temperature 0.8 --seed 0"
    )


def test_demo_passes():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = paged_jax.demo.main(["--seed", "1"])
    assert rc == 0, out.getvalue()
    assert "OK: paged attention matches dense attention" in out.getvalue()

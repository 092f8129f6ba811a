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


def _blocks_and_extras(doc: pathlib.Path) -> list[tuple[tuple[str, ...], str]]:
    """Each Python block of ``doc`` with the extras its page names for it: those of the
    last ``pip install -e ".[...]"`` of the block's own section (from its ``##`` heading
    down to the block), else none (the plain install)."""
    text = doc.read_text()
    out = []
    for m in re.finditer(r"```python\n(.*?)```", text, re.S):
        before = text[: m.start()]
        section = before[before.rfind("\n## ") + 1 :]
        named = re.findall(r'pip install -e "\.\[([a-z0-9,]+)\]"', section)
        out.append((tuple(sorted(named[-1].split(","))) if named else (), m.group(1)))
    return out


def test_the_server_page_names_the_extras_of_its_example():
    # Issue 87, item 2: the example imports openai, which neither the serve extra nor the
    # README installed (ModuleNotFoundError in a fresh venv)
    ((extras, code),) = _blocks_and_extras(ROOT / "docs" / "SERVER.md")
    assert extras == ("client", "serve") and "import openai" in code
    assert "temperature=0" in code  # (item 3: a greedy answer shows what the model does)


@pytest.mark.slow  # a virtual environment per set of extras, installed from the index
def test_every_python_block_runs_in_a_venv_with_only_the_extras_its_page_names(tmp_path):
    import os
    import subprocess
    import sys

    by_extras: dict[tuple[str, ...], list[tuple[str, str]]] = {}
    for doc in DOCS:
        for k, (extras, code) in enumerate(_blocks_and_extras(doc)):
            by_extras.setdefault(extras, []).append((f"{doc.name} block {k}", code))
    assert set(by_extras) == {(), ("client", "serve")}, sorted(by_extras)
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(tmp_path),
        "PAGED_JAX_CACHE": str(tmp_path / "cache"),
        "JAX_PLATFORMS": "cpu",
    }
    for pip_cache in (pathlib.Path.home() / ".cache" / "pip",):  # reuse downloads
        if pip_cache.is_dir():
            env["PIP_CACHE_DIR"] = str(pip_cache)
    for n, (extras, blocks) in enumerate(sorted(by_extras.items())):
        venv = tmp_path / f"venv{n}"
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
        target = f"{ROOT}[{','.join(extras)}]" if extras else str(ROOT)
        run = subprocess.run(
            [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "-e", target],
            capture_output=True,
            text=True,
            timeout=1200,
            env=env,
        )
        assert run.returncode == 0, run.stderr[-3000:]
        for where, code in blocks:
            run = subprocess.run(
                [str(venv / "bin" / "python"), "-c", code],
                capture_output=True,
                text=True,
                timeout=600,
                cwd=tmp_path,
                env=env | {"XLA_FLAGS": os.environ.get("XLA_FLAGS", "")},
            )
            assert run.returncode == 0, f"{where} with extras {extras}:\n{run.stderr[-3000:]}"

"""The README's example runs as printed, and the demo passes its own check."""

import contextlib
import io
import pathlib
import re

import paged_jax.demo

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_readme_example_runs_as_printed():
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Example") :]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {})
    assert out.getvalue().strip() == "(20, 8, 64)"


def test_every_python_block_of_the_readme_runs():
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) >= 4
    for k, code in enumerate(blocks):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(code, f"README.md block {k}", "exec"), {})


def test_readme_has_exactly_two_setup_commands_and_ci_runs_the_second():
    text = (ROOT / "README.md").read_text()
    setup = text[text.index("## Set-up") : text.index("## Engine")]
    commands = re.findall(r"```bash\n(.*?)\n```", setup, re.S)
    assert len(commands) == 2
    assert commands[1] in (ROOT / ".ci" / "run").read_text()


def test_readme_demo_command_is_the_cli():
    text = (ROOT / "README.md").read_text()
    setup = text[text.index("## Set-up") : text.index("## Engine")]
    first = re.findall(r"```bash\n(.*?)\n```", setup, re.S)[0]
    assert first.endswith("paged-jax generate -n 2 --temperature 0.8 --seed 0")


def test_demo_passes():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = paged_jax.demo.main(["--seed", "1"])
    assert rc == 0, out.getvalue()
    assert "OK: paged attention matches dense attention" in out.getvalue()

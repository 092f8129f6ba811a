"""The `paged-jax` console script, run as a real subprocess."""

import json
import subprocess
import sys

import pytest

CLI = [sys.executable, "-m", "paged_jax.cli"]


def _run(*args, timeout=300):
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)


def test_generate_end_to_end_json():
    proc = _run(
        "generate",
        "--prompt",
        "hello",
        "--prompt",
        "paged attention",
        "-n",
        "2",
        "--max-tokens",
        "5",
        "--temperature",
        "0.7",
        "--seed",
        "3",
        "--ignore-eos",
        "--page-size",
        "8",
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert [o["prompt"] for o in data["outputs"]] == ["hello", "paged attention"]
    assert all(len(c["token_ids"]) == 5 for o in data["outputs"] for c in o["completions"])
    assert data["metrics"]["requests"] == 2 and data["metrics"]["max pages shared"] >= 1


def test_generate_prints_outputs_and_metrics_table():
    proc = _run("generate", "--max-tokens", "4", "--no-progress")
    assert proc.returncode == 0, proc.stderr
    assert "prompt: 'Once upon a time'" in proc.stdout and "engine metrics" in proc.stdout


@pytest.mark.parametrize(
    "args,message",
    [
        (["--prompt", ""], "--prompt: prompt 1 is empty"),
        (
            ["--prompt", "x" * 5000],
            "prompts[0]: prompt: 5001 tokens, the model's maximum length is 4096 "
            "(one more is needed to generate)",
        ),
        (["-n", "0"], "-n: expected >= 1, got 0"),
        (["--presence-penalty", "3"], "--presence-penalty: expected a float in [-2, 2], got 3.0"),
        (["--top-p", "1.5"], "--top-p: expected a value in (0, 1], got 1.5"),
        (
            ["--model", "/no/such/dir"],
            "--model: '/no/such/dir' is neither 'tiny-llama' nor a checkpoint directory",
        ),
        (["--prompts-file", "/no/such/file"], "--prompts-file: /no/such/file does not exist"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(args, message):
    proc = _run("generate", "--no-progress", *args)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"paged-jax: error: {message}"
    assert "Traceback" not in proc.stderr


def test_ctrl_c_is_one_line_and_exit_code_130(monkeypatch, capsys):
    from paged_jax import cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_generate", interrupted)
    assert cli.main(["generate", "--no-progress"]) == 130
    assert capsys.readouterr().err == "paged-jax: interrupted\n"


def test_sampling_errors_name_the_flag():
    from paged_jax import cli

    assert cli._flag_names("min_p: expected a float in [0, 1], got 1.5") == (
        "--min-p: expected a float in [0, 1], got 1.5"
    )
    assert cli._flag_names("prompt: 5 tokens") == "prompt: 5 tokens"
    assert cli._flag_names("seed: expected None or an int") == "--seed: expected None or an int"


def test_a_request_the_engine_fails_is_reported_and_exits_1(monkeypatch, capsys):
    from paged_jax import cli
    from paged_jax.engine import llm as llm_mod

    real = llm_mod.LLM._penalties

    def breaks(self, work, rows, S_b):  # any step that runs the prompt "bad" raises
        if any(w.group.prompt == [256, *b"bad"] for w in work):
            raise RuntimeError("boom")
        return real(self, work, rows, S_b)

    monkeypatch.setattr(llm_mod.LLM, "_penalties", breaks)
    argv = ["generate", "--prompt", "good", "--prompt", "bad", "--max-tokens", "3", "--json"]
    assert cli.main([*argv, "--no-progress"]) == 1
    captured = capsys.readouterr()
    data = json.loads(captured.out)
    good, bad = data["outputs"]
    assert good["error"] is None and len(good["completions"][0]["token_ids"]) == 3
    assert bad["error"] == "RuntimeError: boom"
    assert bad["completions"][0]["finish_reason"] == "error"
    assert captured.err.strip().endswith("paged-jax: error: prompt(s) [2] failed (see above)")

"""The installed distribution: one top-level name, imports pointing one way."""

import ast
import pathlib
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _imports(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``path``; relative imports as '.'."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                out.append((node.lineno, "."))
            else:
                out.append((node.lineno, node.module or ""))
                if node.module == "paged_jax":  # from paged_jax import models
                    out += [(node.lineno, f"paged_jax.{a.name}") for a in node.names]
    return out


def _violations(folder: str, allowed) -> list[str]:
    bad = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        for line, mod in _imports(path):
            if not allowed(path.relative_to(ROOT).as_posix(), mod):
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {mod}")
    return bad


def _top(mod: str) -> str:
    return mod.split(".")[0]


def test_kernels_import_only_jax_numpy_and_themselves():
    ok = {"jax", "jaxlib", "numpy", "ml_dtypes", "triton", "rich"}  # rich: the aot reports

    def allowed(_, mod):
        return mod == "." or _top(mod) in ok or _top(mod) in sys.stdlib_module_names

    assert _violations("pallas_kernels", allowed) == []


def test_core_and_engine_never_import_the_model_layer():
    """kernels <- core <- models <- engine, CLI: the CLI and ``LLM`` (a name or path in
    place of a model, as vLLM's ``LLM(model=...)``) turn names into models; the core and
    the rest of the engine never import the model layer."""

    def allowed(path, mod):
        if path.startswith("paged_jax/cli/") or path == "paged_jax/engine/llm.py":
            return True
        return not (mod.startswith("paged_jax.models") or _top(mod) in ("models", "pallas_kernels"))

    assert _violations("paged_jax", allowed) == []


def test_models_reach_kernels_only_through_the_core():
    def allowed(_, mod):
        return not (mod.startswith("paged_jax.kernels") or mod.startswith("paged_jax.engine"))

    assert _violations("models", allowed) == []


def _pyproject() -> str:
    return (ROOT / "pyproject.toml").read_text()  # read as text: tomllib is 3.11+


def test_distribution_claims_only_the_paged_jax_name():
    import re

    listed = re.search(r"^packages = \[(.*?)\]", _pyproject(), re.S | re.M).group(1)
    packages = re.findall(r'"([\w.]+)"', listed)
    assert "paged_jax.models" in packages and "paged_jax.kernels.tpu" in packages
    assert {p.split(".")[0] for p in packages} == {"paged_jax"}
    mapped = dict(re.findall(r'^"(paged_jax\.\w+)" = "(\w+)"$', _pyproject(), re.M))
    assert mapped == {"paged_jax.models": "models", "paged_jax.kernels": "pallas_kernels"}


def test_the_wheel_carries_the_cpu_kernel_source(tmp_path):
    """The CPU backend compiles ``decode.c`` from the installed package on first use."""
    import importlib.util
    import zipfile

    # Build in this environment when it has the build backend (offline-friendly); a fresh
    # venv without setuptools (Python 3.12+) gets pip's isolated build from the index.
    have_backend = all(importlib.util.find_spec(m) for m in ("setuptools", "wheel"))
    isolation = ["--no-build-isolation"] if have_backend else []
    run = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", *isolation]
        + ["-w", str(tmp_path), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    (wheel,) = tmp_path.glob("paged_jax-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"paged_jax/kernels/cpu/__init__.py", "paged_jax/kernels/cpu/decode.c"} <= names


@pytest.mark.slow  # 30-54 s (a virtual environment and an install); .ci/run runs it
def test_a_user_project_with_its_own_models_package(tmp_path):
    """A project with a ``models`` package of its own keeps it, and the library still finds
    its models and kernels (installed as paged_jax.models / paged_jax.kernels)."""
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "__init__.py").write_text("MINE = 'the user project'\n")
    script = textwrap.dedent(
        """
        import models
        import paged_jax as pj
        from paged_jax import models as library_models
        from paged_jax.kernels import tpu

        llm = pj.LLM(*library_models.load("tiny-llama"), num_pages=16, page_size=8,
                     compilation_cache=False)
        out = llm.generate([[1, 2, 3]], pj.SamplingParams(max_tokens=3, ignore_eos=True),
                           progress=False)
        print(models.MINE, len(out[0].outputs[0].token_ids), callable(tpu.write_rows))
        """
    )
    run = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "JAX_PLATFORMS": "cpu"},
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["the", "user", "project", "3", "True"]


def test_a_name_given_below_the_engine_points_to_the_model_layer():
    """``LLM`` loads a name itself (tests/test_examples.py); the model runner and the
    protocol check below it point to the model layer instead."""
    import paged_jax as pj
    from paged_jax.engine.protocol import check_model

    with pytest.raises(TypeError, match=r"paged_jax\.models\.load\('tiny-llama'\)"):
        check_model("tiny-llama")
    with pytest.raises(TypeError, match=r"needs to be a flax\.nnx\.Module.*config.*make_cache"):
        pj.LLM(object())


def test_version_flag_names_the_package_and_jax():
    import re

    import jax

    import paged_jax

    version = re.search(r'^version = "(.*)"$', _pyproject(), re.M).group(1)
    assert paged_jax.__version__ == version
    run = subprocess.run(
        [sys.executable, "-m", "paged_jax.cli", "--version"], capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith(f"paged-jax {version} (jax {jax.__version__}, jaxlib ")


def test_a_checkout_without_an_install_imports_the_model_layer_and_kernels(tmp_path):
    # PYTHONPATH=. from a checkout: models/ and pallas_kernels/ are paged_jax.models and
    # paged_jax.kernels there too (an install's finder is taken out of the way first).
    code = textwrap.dedent(
        f"""
        import sys
        sys.meta_path[:] = [
            f for f in sys.meta_path
            if "editable" not in (getattr(f, "__module__", "") + getattr(f, "__name__", ""))
        ]
        sys.path.insert(0, {str(ROOT)!r})
        import paged_jax
        from paged_jax import models
        from paged_jax.kernels import gpu
        print(models.__file__)
        print(gpu.__file__)
        print(type(models.load("tiny-llama")[0]).__name__)
        """
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    lines = p.stdout.split()
    assert lines[0] == str(ROOT / "models" / "__init__.py")
    assert lines[1] == str(ROOT / "pallas_kernels" / "gpu" / "__init__.py")
    assert lines[2] == "LlamaForCausalLM"

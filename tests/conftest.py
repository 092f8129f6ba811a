"""Test-wide settings: strict rank promotion, deterministic hypothesis, CPU-only JAX."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Engines keep compiled steps on disk by default; the tests' own go under .pytest_cache
# (a rerun then starts warm), not into the user's cache directory.
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("PAGED_JAX_COMPILATION_CACHE", os.path.join(_REPO, ".pytest_cache", "xla"))
# The suite compiles hundreds of small XLA:CPU programs, and a fresh clone has none of
# them in the cache above, so compiling is most of a cold run. Two flags make it cheaper:
# - LLVM's optimization of their machine code off: a fresh clone's run took 6:00 on 2
#   cores instead of 7:31 (2026-11-24), every test passing as before. XLA builds the
#   same programs (HLO); their code runs slower, which these small shapes hardly notice.
# - XLA:CPU's older fusion emitters instead of its MLIR ones, which take twice as long to
#   compile an engine step: a cold run's XLA compilation of three engine tests went from
#   25-26 s to 12-13 s (2026-11-29), the same tokens. Only below jaxlib 0.11: its XLA has
#   no such flag, and XLA stops the process at an unknown one.
# On CPU only, and each only where XLA_FLAGS names it not itself (name it to test otherwise).
FAST_COMPILE = {"xla_backend_optimization_level": "0"}


def _jaxlib_below_0_11() -> bool:
    from importlib.metadata import version

    major, minor = (int(part) for part in version("jaxlib").split(".")[:2])
    return (major, minor) < (0, 11)


if _jaxlib_below_0_11():
    FAST_COMPILE["xla_cpu_use_fusion_emitters"] = "false"
if os.environ["JAX_PLATFORMS"] == "cpu":
    _flags = os.environ.get("XLA_FLAGS", "")
    for _name, _value in FAST_COMPILE.items():
        if _name not in _flags:
            _flags = f"{_flags} --{_name}={_value}".strip()
    os.environ["XLA_FLAGS"] = _flags

import gc  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

from paged_jax.engine import compile_cache  # noqa: E402
from paged_jax.models.hf import release_freed_memory  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")

# The suite's own programs go to the persistent cache from 0.02 s of compiling up (the
# engine asks 0.2 s, for a user's steps): a fresh clone then compiles each eager op,
# model initializer and small step once, where both workers and every module compiled
# their own (docs/TESTING.md has the runs that chose this and the dropping below).
if compile_cache.enable() is not None:  # off where PAGED_JAX_COMPILATION_CACHE says off
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.02)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

# derandomize: the same examples on every run and machine, so a CI failure reproduces.
settings.register_profile(
    "default",
    max_examples=25,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("thorough", max_examples=300, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_programs():
    """Drops JAX's compiled programs after a test module once the worker holds more than
    ``_DROP_ABOVE_BYTES``. A worker otherwise keeps every program of every module it ran
    (thousands of eager ops and kernel grids), and the two workers of ``pytest -n 2`` grew
    past 8 GB together. Dropping them after every module instead made the next modules
    trace, lower and compile their eager ops again (docs/TESTING.md has the runs); a
    worker now peaks near 3 GB.

    They are dropped too once the worker maps more than a quarter of the kernel's limit
    of memory regions (``vm.max_map_count``, 65,530 by default): each compiled program
    maps about 10, and under JAX 0.11.2 a worker's maps grew faster than its memory
    (42,000 at 2.6 GB resident), so CI reached the limit first and LLVM failed to compile
    ("Cannot allocate memory", 2026-12-07). A module adds up to 15,000 (test_warm_up.py),
    so a quarter leaves room for the module that crosses it."""
    yield
    resident, maps = _resident_bytes(), _mapped_regions()
    if resident is None or resident > _DROP_ABOVE_BYTES or maps is None or maps > _DROP_ABOVE_MAPS:
        jax.clear_caches()
        gc.collect()
        # the freed heap back to the OS: without it a worker's resident memory never
        # shrank (0.4 -> 1.4 GB over test_attention.py, and 1.4 GB from then on)
        release_freed_memory()


_DROP_ABOVE_BYTES = int(2.5 * 2**30)


def _map_limit() -> int:
    """The kernel's limit of memory regions a process maps (``vm.max_map_count``)."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 65530


_DROP_ABOVE_MAPS = _map_limit() // 4


def _mapped_regions() -> int | None:
    """How many memory regions this process maps (Linux: the lines of
    ``/proc/self/maps``), or None where it cannot be read."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return None


def _resident_bytes() -> int | None:
    """This process's resident memory in bytes (Linux), or None where it cannot be read
    (the programs are then dropped after every module)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


_METRICS: list = []


@pytest.fixture(autouse=True)
def _no_failed_steps(request):
    """Fails a test any of whose engines had a failed step, unless it is marked
    ``failing_steps`` (it makes steps fail on purpose). The engine undoes a failed step
    and runs its requests again (``LLM.generate`` goes on), so the outputs alone can be
    right while every step of some kind fails: a speculative engine once failed each
    step that verified proposals beside a row with a logit bias, and recovered."""
    from paged_jax.engine import metrics

    original = metrics.EngineMetrics.__init__

    def init(self, *a, **k):
        original(self, *a, **k)
        _METRICS.append(self)

    metrics.EngineMetrics.__init__ = init
    _METRICS.clear()
    try:
        yield
    finally:
        metrics.EngineMetrics.__init__ = original
    failed = [m.failed_steps for m in _METRICS if m.failed_steps]
    _METRICS.clear()
    if failed and request.node.get_closest_marker("failing_steps") is None:
        pytest.fail(
            f"engine steps failed and were recovered from ({failed}); mark the test "
            "failing_steps if it makes them fail on purpose"
        )


@pytest.fixture
def verify_freely(monkeypatch):
    """Every proposal the other rules take is verified, whatever a verify step costs on
    this CPU (``VERIFY_COST``, tested apart): tests of what verifying computes need
    verify steps, and a tiny random model's proposals rarely pay for them."""
    from paged_jax.engine.speculative import verifier

    monkeypatch.setattr(verifier, "VERIFY_COST", 0.0)

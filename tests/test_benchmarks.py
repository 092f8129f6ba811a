"""The memory benchmark's measures, on small cases where the answer is known."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_memory import simulate_paged, simulate_reserved  # noqa: E402
from benchmarks.workloads import WORKLOADS, sample_lengths  # noqa: E402


def test_reserved_effective_memory_hand_worked():
    # One request, prompt 3 + output 2, reserving 10 slots: after its two steps it holds
    # 4 then 5 tokens of 10 reserved -> (4 + 5) / 20.
    r = simulate_reserved([(3, 2)], budget=10, reserve=lambda p, o: 10)
    assert r["effective"] == 9 / 20 and r["steps"] == 2


def test_paged_page_size_one_wastes_nothing_and_beats_max_reservation():
    lengths = sample_lengths("alpaca", 40, seed=3, max_len=256)
    assert simulate_paged(lengths, budget=2048, page_size=1)["effective"] == 1.0
    paged16 = simulate_paged(lengths, budget=2048, page_size=16)
    contiguous = simulate_reserved(lengths, budget=2048, reserve=lambda p, o: 256)
    assert contiguous["effective"] < paged16["effective"] < 1.0
    assert paged16["concurrency"] > contiguous["concurrency"]


def test_workload_means_follow_the_documented_figures():
    for name, w in WORKLOADS.items():
        lengths = sample_lengths(name, 20000, seed=0, max_len=100000)
        mp = sum(p for p, _ in lengths) / len(lengths)
        mo = sum(o for _, o in lengths) / len(lengths)
        assert abs(mp / w.prompt_mean - 1) < 0.05 and abs(mo / w.output_mean - 1) < 0.05


def test_kernel_tuning_sweep_refuses_to_run_without_a_gpu():
    import jax
    import pytest

    from benchmarks import bench_kernels

    if jax.default_backend() == "gpu":
        pytest.skip("on a GPU --tune runs (and takes minutes)")
    with pytest.raises(SystemExit) as err:
        bench_kernels.main(["--tune"])
    assert err.value.code == 2

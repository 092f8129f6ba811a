"""docs/SCALING.md shows what benchmarks/scaling_model.py computes, and the model's
arithmetic holds on figures checked by hand."""

import pathlib

from benchmarks import scaling_model as sm

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_the_page_shows_the_scripts_tables():
    page = (ROOT / "docs" / "SCALING.md").read_text(encoding="utf-8")
    assert sm.tables(64, 4096) in page


def test_parameter_counts_and_one_row_by_hand():
    eight, seventy = sm.MODELS
    assert round(eight.params / 1e9, 2) == 8.03 and round(seventy.params / 1e9, 2) == 70.55
    h100 = sm.CHIPS[2]
    r = sm.step(eight, h100, 1, 64, 4096)
    # KV: 64 x 4096 tokens x 32 layers x 2 (K, V) x 8 heads x 128 x 2 bytes
    assert abs(r["kv_gb"] - 64 * 4096 * 32 * 2 * 8 * 128 * 2 / 1e9) < 1e-9
    assert r["collectives"] == 0 and r["t_comm_ms"] == 0
    r8 = sm.step(eight, h100, 8, 64, 4096)
    assert r8["collectives"] == 2 * 32 + 1
    assert abs(r8["kv_gb"] * 8 - r["kv_gb"]) < 1e-9  # KV heads split 8 ways

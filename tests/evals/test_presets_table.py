"""`hf_asymkv.evals.presets_table`: bytes per preset and ablation, and the tables, on a tiny model."""

from __future__ import annotations

import pytest

from hf_asymkv import PRESETS
from hf_asymkv.bench.schemes import SCHEMES
from hf_asymkv.evals import presets_table as pt


def test_every_preset_and_ablation_is_a_scheme():
    names = pt.preset_schemes() + pt.ablation_schemes()
    assert names[: len(PRESETS)] == [f"asymkv-{p}" for p in PRESETS]
    assert all(n in SCHEMES for n in names + pt.BASELINES)
    assert pt.ablation_schemes() == names[len(PRESETS):]  # registering twice changes nothing


def test_bytes_and_tables(llama, single_thread):
    schemes = pt.BASELINES + pt.preset_schemes() + ["abl-balanced-no-rotation"]
    pt.ablation_schemes()
    ratios = pt.measure_bytes(llama, schemes, 256)
    assert ratios["dynamic"] == 1.0
    assert min(ratios["asymkv-max"], ratios["asymkv-compact"]) > ratios["asymkv-balanced"] > 1.2  # 256 tokens: windows weigh
    # rotation costs no bytes
    assert ratios["abl-balanced-no-rotation"] == pytest.approx(ratios["asymkv-balanced"])
    damage = {"asymkv-balanced": {"prompts": 2, "correct": 2, "lost": 0, "gained": 0, "changed": 1, "kl_sum": 0.5}}
    rows = pt.build_rows(schemes, ratios, ratios, damage)
    text = pt.format_tables(rows, 256)
    assert "| asymkv-balanced | " in text and "| 2/2 | 0 / 0 | 1 | 2.50e-01 |" in text
    assert "### Ablations" in text and "balanced with V rotation off" in text


def test_scheme_names_list_every_preset():
    """bench/schemes.py names the presets without importing torch; the two lists must agree."""
    from hf_asymkv import PRESETS
    from hf_asymkv.bench.schemes import PRESET_NAMES, SCHEMES

    assert list(PRESET_NAMES) == list(PRESETS)
    assert all(f"asymkv-{name}" in SCHEMES for name in PRESETS)

"""hf_asymkv/bench/static_report.py: each scheme's ratio to its baseline (compiled: the compiled StaticCache;
eager: DynamicCache with flash SDPA) at the same batch and context, and the issue's targets."""

from __future__ import annotations

from hf_asymkv.bench.static_report import static_markdown, static_rows

COMPILED = {"hf-static-compiled", "balanced-static-fused-compiled", "compact-static-fused-compiled"}


def _row(scheme: str, batch: int, context: int, ms: float, status: str = "ok") -> dict:
    return dict(scheme=scheme, batch=batch, context=context, status=status, decode_ms=ms, kv_bytes=2**30,
                peak_gib=1.0, launches_per_step=3.0, kernels_per_step=None, attention_kernels_per_step=None)


def test_ratios_against_each_baseline_and_targets():
    rows = static_rows([_row("hf-static-compiled", 1, 32768, 3.0), _row("balanced-static-fused-compiled", 1, 32768, 2.1),
                        _row("balanced-static-fused-compiled", 8, 32768, 2.0),  # no baseline at batch 8
                        _row("dynamic-flash", 1, 131072, 10.0), _row("balanced-triton", 1, 131072, 12.0),
                        _row("compact-static-fused-compiled", 1, 131072, 1.0, status="out of memory")], COMPILED)
    by = {(r["scheme"], r["batch"], r["context"]): r for r in rows}
    ours = by["balanced-static-fused-compiled", 1, 32768]
    assert ours["baseline"] == "hf-static-compiled" and abs(ours["ratio"] - 0.7) < 1e-12
    assert ours["target"] == 0.8 and ours["met"] is True
    assert by["balanced-static-fused-compiled", 8, 32768]["ratio"] is None
    assert by["balanced-static-fused-compiled", 8, 32768]["met"] is None
    eager = by["balanced-triton", 1, 131072]
    assert eager["baseline"] == "dynamic-flash" and eager["ratio"] == 1.2 and eager["met"] is False
    assert by["hf-static-compiled", 1, 32768]["baseline"] is None
    assert by["compact-static-fused-compiled", 1, 131072]["target"] == 0.5
    text = static_markdown(rows)
    assert "| balanced-static-fused-compiled | 1 | 32768 | 2.10 | 3 | - | - | hf-static-compiled | 0.70 | 0.80 | True |" \
        in text
    assert "| compact-static-fused-compiled | 1 | 131072 | out of memory |" in text

"""Memory and decode-speed measurement on a tiny model: every scheme measured, ratios against DynamicCache."""

import pytest

from hf_asymkv.bench.kv_memory import format_memory_table, measure_kv_memory
from hf_asymkv.cli import main

pytestmark = pytest.mark.usefixtures("single_thread")
SCHEMES = ["asymkv", "hf-quanto-int4", "hf-fp8", "k4v4-sym"]


def test_memory_rows_and_ratios(llama):
    rows = measure_kv_memory(llama, SCHEMES, [300], decode_tokens=3)
    assert [r.scheme for r in rows] == ["dynamic", *SCHEMES]
    dynamic = rows[0]
    cfg = llama.config
    # 2 layers x (K, V) x kv heads x 300 tokens x head_dim x 2 bytes (bf16)
    assert dynamic.prefill_bytes == cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * 300 * cfg.head_dim * 2
    assert dynamic.ratio_vs_dynamic == 1.0
    assert all(r.decode_bytes >= r.prefill_bytes for r in rows)
    assert next(r for r in rows if r.scheme == "asymkv").ratio_vs_dynamic > 1.2
    assert format_memory_table(rows).count("\n") == len(rows) + 1


def test_unknown_scheme_is_named(llama):
    with pytest.raises(ValueError, match="Unknown cache scheme 'nope'; known schemes"):
        measure_kv_memory(llama, ["nope"], [16])


@pytest.mark.parametrize("argv, message", [
    (["memory", "--lengths", "0,1024"], "expected positive integers, got '0,1024'"),
    (["bench", "--lengths", "4k"], "expected comma-separated integers, got '4k'"),
    (["memory", "--kv-dtype", "int8"], "invalid choice: 'int8'"),
], ids=["zero-length", "not-a-number", "bad-kv-dtype"])
def test_bad_flags_exit_2_with_argparse_message(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_scheme_attention_names_the_core_implementation():
    """bench/schemes.py spells the fused attention's name without importing the core (the CLI lists schemes
    without torch); it must stay the core's name."""
    from hf_asymkv.bench.schemes import ATTENTION, PRESET_NAMES
    from hf_asymkv.core.attention import ATTN_IMPLEMENTATION

    assert set(ATTENTION.values()) == {ATTN_IMPLEMENTATION}
    assert set(ATTENTION) == {"asymkv-fused", *(f"asymkv-{name}-fused" for name in PRESET_NAMES),
                              *(f"asymkv-{name}-static-fused{tail}" for name in PRESET_NAMES for tail in ("", "-compiled"))}

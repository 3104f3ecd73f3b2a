"""The demo's table: ratios against the first (full-precision) row, answers shown whole."""

from hf_asymkv.evals.demo import DemoRow, format_demo


def test_format_demo_ratio_answer_and_dtype_note():
    rows = [DemoRow("DynamicCache", "The code is 3471.", True, 4 * 2**20, 7.0),
            DemoRow("AsymKVCache", "The code is 3471.", True, 2**20, 7.5)]
    info = {"prompt_tokens": 3112, "expected": "3471", "depth": 0.35, "key": "glass door", "dtype": "float32"}
    text = format_demo(rows, info)
    assert "3112 tokens" in text and "(3471) sits 35% into the document" in text
    ours = next(line for line in text.splitlines() if line.startswith("AsymKVCache"))
    assert "4.00" in ours and "yes" in ours and "The code is 3471." in ours
    assert "model dtype float32" in text

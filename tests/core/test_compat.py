"""`hf_asymkv.core.compat`: each shim on the installed transformers, and no release check anywhere else."""

from __future__ import annotations

import ast
import warnings
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicSlidingWindowLayer

from hf_asymkv import AsymKVCache, cache_kwargs
from hf_asymkv.core import compat
from hf_asymkv.core.kv_view import QuantizedKV
from hf_asymkv.core.packing import PackedCodes
from hf_asymkv.core.quant import QuantSpec

pytestmark = pytest.mark.releases  # depends on transformers' behaviour: CI reruns it on older releases

ROOT = Path(__file__).resolve().parents[2]
COMPAT = ROOT / "hf_asymkv" / "core" / "compat.py"
CHECKED = sorted(p for d in ("hf_asymkv", "scripts", "tests") for p in (ROOT / d).rglob("*.py")
                 if p not in (COMPAT, Path(__file__).resolve()))


def test_cache_kwargs_names_the_installed_releases_keyword():
    cache = object()
    assert cache_kwargs(cache) == {compat.CACHE_KWARG: cache}
    assert compat.CACHE_KWARG == ("cache" if compat.TRANSFORMERS_VERSION >= (5, 24) else "past_key_values")


@torch.no_grad()
def test_forward_uses_the_cache_and_warns_nothing(llama, prompt, single_thread):
    """The keyword reaches the model on this release (a wrong one is ignored silently before 5.24) and is not a
    deprecated spelling (5.24+ warns for past_key_values)."""
    cache = AsymKVCache(llama.config)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        llama(prompt[:, :10], **cache_kwargs(cache), use_cache=True)
    assert cache.get_seq_length() == 10


@pytest.mark.parametrize("arg, expected_new, expected_old", [(0, 0, 0), (-3, -3, -3), (7, 7, -3)],
                         ids=["zero", "negative", "positive"])
def test_crop_tokens_to_remove(arg, expected_new, expected_old):
    """Length 10: a positive argument is the length to keep below 5.14 (7 -> remove 3), passed through (and
    refused by the layer) from 5.14; 0-d tensors become ints."""
    expected = expected_old if compat.CROP_TAKES_LENGTH_TO_KEEP else expected_new
    assert compat.crop_tokens_to_remove(arg, 10) == expected
    got = compat.crop_tokens_to_remove(torch.tensor(arg), 10)
    assert type(got) is int and got == expected


@pytest.mark.parametrize("arg", [3, torch.arange(5, 8)], ids=["length", "cache_position"])
def test_mask_query_length(arg):
    assert compat.mask_query_length(arg) == 3


@pytest.mark.parametrize("name", ["llama", "hybrid", "shared_kv"])
def test_layer_types_line_up_with_dynamic_cache(request, name):
    config = request.getfixturevalue(name).config.get_text_config(decoder=True)
    types = compat.cache_layer_types(config)
    layers = DynamicCache(config=config).layers
    assert len(types) == len(layers)
    for layer_type, layer in zip(types, layers):
        sliding = layer_type in ("sliding_attention", "chunked_attention")
        assert sliding == isinstance(layer, DynamicSlidingWindowLayer)


def test_reset_layer_empties_a_sliding_window():
    layer = DynamicSlidingWindowLayer(sliding_window=4)
    layer.update(torch.ones(1, 2, 6, 8), torch.ones(1, 2, 6, 8))
    compat.reset_layer(layer)
    assert layer.get_seq_length() == 0 and layer.cumulative_length == 0


def test_quantized_kv_to_device():
    codes = PackedCodes(torch.zeros(1, 1, 0, 8, dtype=torch.uint8), 8, "head_dim", 8)
    kv = QuantizedKV(prefix=None, codes=codes, scale=torch.ones(1, 1, 0, 1), zero=None,
                     spec=QuantSpec("int8", "channel", block_size=8), tail=torch.ones(1, 1, 2, 8))
    assert kv.to("cpu") is kv
    moved = kv.to("meta")
    assert moved.device.type == moved.codes.data.device.type == moved.scale.device.type == "meta"
    assert moved.prefix is None and moved.zero is None


def _release_checks(path: Path) -> list[str]:
    """Comparisons involving ``transformers.__version__``, calls of ``transformers_at_least`` and imports of
    ``packaging`` (the version parser) in one file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        hit = False
        if isinstance(node, ast.Compare):
            hit = any(isinstance(n, ast.Attribute) and n.attr == "__version__" and isinstance(n.value, ast.Name)
                      and n.value.id == "transformers" for n in ast.walk(node))
        elif isinstance(node, ast.Call):
            func = node.func
            hit = getattr(func, "attr", getattr(func, "id", None)) == "transformers_at_least"
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            hit = any(m.split(".")[0] == "packaging" for m in modules)
        if hit:
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_release_check_outside_compat():
    bad = [hit for path in CHECKED for hit in _release_checks(path)]
    assert not bad, f"transformers release checks belong in hf_asymkv/core/compat.py: {bad}"


def test_release_check_finder_sees_one():
    assert _release_checks(COMPAT)

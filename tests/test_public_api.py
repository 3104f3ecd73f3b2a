"""What ``help(AsymKVCache)`` and the README point a user at exists: every ``hf_asymkv.X`` name resolves, and every
bare ``:data:`NAME``` in the public docstrings is importable from ``hf_asymkv``."""

from __future__ import annotations

import importlib
import pydoc
import re

import pytest

import hf_asymkv

DOCUMENTED = ["AsymKVCache", "AsymKVConfig", "KVScales"]


def _resolve(dotted: str):
    """The object named ``hf_asymkv.a.b``: a module, then attributes."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


@pytest.mark.parametrize("name", DOCUMENTED)
def test_help_points_only_at_names_that_exist(name):
    text = pydoc.render_doc(getattr(hf_asymkv, name), renderer=pydoc.plaintext)
    dotted = set(re.findall(r"~?(hf_asymkv(?:\.\w+)+)", text))
    assert dotted, "expected references to check"
    for ref in dotted:
        _resolve(ref)
    for bare in re.findall(r":data:`(\w+)`", text):
        assert bare in hf_asymkv.__all__, f"help({name}) names {bare}, which hf_asymkv does not export"


def test_all_lists_exactly_the_lazy_public_names():
    """``__all__`` is written out for static tools; it must name what ``__getattr__`` serves, no more, no less."""
    assert sorted(hf_asymkv.__all__) == sorted([*hf_asymkv._PUBLIC, "__version__"])


def test_constants_are_public():
    from hf_asymkv import KEY_FORMATS, OVERFLOW_POLICIES, VALUE_BITS

    assert "int8" in KEY_FORMATS and 4 in VALUE_BITS and "widen" in OVERFLOW_POLICIES


def test_docstring_example_passes_the_cache_under_the_installed_name():
    doc = hf_asymkv.AsymKVCache.__doc__
    assert "model.generate(**inputs, **cache_kwargs(cache)" in doc and "past_key_values=cache" not in doc


def test_readme_pipeline_example_uses_the_cache(llama):
    """The README's ``pipeline("text-generation")`` call (``cache_kwargs``: ``cache=`` on 5.24+): the cache is the one
    generate fills."""
    from helpers import WORDS, word_tokenizer
    from transformers import pipeline

    generator = pipeline("text-generation", model=llama, tokenizer=word_tokenizer())
    cache = hf_asymkv.AsymKVCache(llama.config, residual_length=8, key_block_size=8)
    out = generator(" ".join(WORDS[:40]), **hf_asymkv.cache_kwargs(cache), max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert isinstance(out[0]["generated_text"], str)
    assert cache.get_seq_length() >= 40 and cache.stats()["tokens_quantized"] > 0

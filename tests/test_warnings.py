"""pyproject's ``filterwarnings``: a FutureWarning/DeprecationWarning attributed to an hf_asymkv module fails the
run; the same warning from another library's module does not (it is only reported); the library's own warning
classes (``CacheReuseWarning``) fail a test that does not expect them."""

from __future__ import annotations

import warnings

import pytest


def _warn_from(module: str, category: type[Warning]) -> None:
    # warn_explicit attributes the warning to `module`, as warnings.warn does for the caller's frame
    warnings.warn_explicit("old name, use the new one", category, filename=f"{module}.py", lineno=1, module=module)


@pytest.mark.parametrize("category", [FutureWarning, DeprecationWarning])
@pytest.mark.parametrize("module", ["hf_asymkv", "hf_asymkv.core.cache", "hf_asymkv.bench.speed"])
def test_deprecation_from_our_code_is_an_error(module, category):
    with pytest.raises(category, match="old name"):
        _warn_from(module, category)


@pytest.mark.parametrize("category", [FutureWarning, DeprecationWarning])
def test_deprecation_from_another_library_is_only_recorded(category):
    with pytest.warns(category):
        _warn_from("torch.nn.modules.module", category)


def test_our_userwarnings_stay_warnings():
    with pytest.warns(UserWarning):
        _warn_from("hf_asymkv.core.layer", UserWarning)


def test_our_own_warning_classes_are_errors_unless_expected():
    from hf_asymkv.core.reuse import CacheReuseWarning

    with pytest.raises(CacheReuseWarning):
        _warn_from("hf_asymkv.core.reuse", CacheReuseWarning)
    with pytest.warns(CacheReuseWarning):  # a test that expects it sees it
        _warn_from("hf_asymkv.core.reuse", CacheReuseWarning)

"""The cache settings the command line offers are the core's own: read from its source without importing torch
(:mod:`hf_asymkv.cli.settings`), equal to the imported values, and shown as the real defaults in ``--help``."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from hf_asymkv import KEY_FORMATS, OVERFLOW_POLICIES, PRESETS, VALUE_BITS, AsymKVConfig
from hf_asymkv.cli import main
from hf_asymkv.cli.app import build_parser
from hf_asymkv.cli.hub import SETTING_FLAGS
from hf_asymkv.cli.settings import core_settings


def test_the_settings_read_from_source_are_the_imported_ones():
    core = core_settings()
    assert core.key_formats == KEY_FORMATS and core.value_bits == VALUE_BITS
    assert core.overflow_policies == OVERFLOW_POLICIES and core.presets == tuple(PRESETS)
    assert set(SETTING_FLAGS) <= {f.name for f in dataclasses.fields(AsymKVConfig)}
    assert {k: core.defaults[k] for k in SETTING_FLAGS} == {k: getattr(AsymKVConfig(), k) for k in SETTING_FLAGS}


def _publish_actions() -> dict[str, argparse.Action]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {a.dest: a for a in sub.choices["publish"]._actions}


@pytest.mark.parametrize("field", SETTING_FLAGS)
def test_publish_help_states_the_real_default(field):
    """The bug this replaces: help said 128 and 0 where the defaults were 64 and 4."""
    default = getattr(AsymKVConfig(), field)
    shown = ("on" if default else "off") if isinstance(default, bool) else str(default)
    assert f"(default {shown})" in _publish_actions()[field].help


@pytest.mark.parametrize("field, values", [("key_format", KEY_FORMATS), ("value_bits", VALUE_BITS),
                                           ("overflow_policy", OVERFLOW_POLICIES), ("preset", tuple(PRESETS))],
                         ids=["key-format", "value-bits", "overflow-policy", "preset"])
def test_publish_choices_are_every_allowed_value(field, values):
    assert tuple(_publish_actions()[field].choices) == values


def test_publish_help_renders(capsys):
    with pytest.raises(SystemExit):
        main(["publish", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--preset {quality,balanced,lean,compact,tight,max}" in text and "int3" in text and "5, 6, 8" in text


def test_key_wide_fraction_flag_takes_a_share():
    check = _publish_actions()["key_wide_fraction"].type
    assert check("0.25") == 0.25 and check("0") == 0.0
    for bad in ("1", "-0.1", "quarter"):
        with pytest.raises(argparse.ArgumentTypeError, match=f"expected a number in \\[0, 1\\), got '{bad}'"):
            check(bad)

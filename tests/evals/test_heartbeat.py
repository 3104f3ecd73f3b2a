"""Long runs say where they are about once a minute, ``--quiet`` or not (`hf_asymkv.evals.common.Heartbeat`)."""

from __future__ import annotations

import re

import pytest
from conftest import _build, llama_config
from helpers import char_tokenizer
from transformers import LlamaForCausalLM

import hf_asymkv.evals.common as common
from hf_asymkv.cli import main
from hf_asymkv.evals.common import Heartbeat

pytestmark = pytest.mark.usefixtures("single_thread")


def test_a_heartbeat_waits_its_interval(capsys):
    beat = Heartbeat("eval x", every=3600)
    beat("step 1")
    assert capsys.readouterr().err == ""


def test_a_zero_interval_prints_every_step(capsys):
    beat = Heartbeat("eval x", every=0)
    beat("step 1")
    beat("step 2")
    assert re.fullmatch(r"eval x: step 1 \(0m0\ds\)\neval x: step 2 \(0m0\ds\)\n", capsys.readouterr().err)


@pytest.mark.parametrize("command", [
    ["eval", "frontier", "--lengths", "600", "--depths", "0.5", "--tasks", "single", "--attention-length", "0",
     "--ppl-length", "0", "--schemes", "asymkv,kivi-2"],
    ["eval", "needle", "--lengths", "600", "--depths", "0.5", "--tasks", "single", "--schemes", "asymkv"],
], ids=["frontier", "needle"])
def test_quiet_runs_still_say_where_they_are(tmp_path, capsys, monkeypatch, command):
    model = tmp_path / "llama"
    _build(LlamaForCausalLM, llama_config(), seed=0).save_pretrained(model)
    char_tokenizer().save_pretrained(model)
    monkeypatch.setattr(common, "HEARTBEAT_SECONDS", 0)
    assert main([*command, "--model", str(model), "--quiet"]) == 0
    lines = capsys.readouterr().err.splitlines()
    name = command[1]
    assert f"eval {name}: needle prompt 1/1, dynamic (1/{3 if name == 'frontier' else 2})" in " ".join(lines)
    assert all(re.search(r"\(\dm\d\ds\)$", line) for line in lines if line.startswith(f"eval {name}:"))

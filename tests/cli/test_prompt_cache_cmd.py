"""`hf-asymkv prompt-cache` on the tiny Llama with a character tokenizer: the file it writes loads and continues, the
figures it prints and writes, its questions (text and chat), and the inputs it refuses before a model loads."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import save_tiny_model

from hf_asymkv import AsymKVCache
from hf_asymkv.cli import main
from hf_asymkv.core.prompt_cache import read_prompt_cache_metadata

TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
DOCUMENT = " ".join(f"Item {i} of the list is a {c} box." for i, c in enumerate(["red", "blue", "green"] * 8))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """The tiny Llama and the character tokenizer (with a small chat template), a text document and chat messages."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("prompt_cache_cli")
    model = save_tiny_model(root / "model")
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(model)
    (root / "doc.txt").write_text(DOCUMENT, encoding="utf-8")
    (root / "chat.json").write_text(json.dumps([{"role": "user", "content": DOCUMENT}]), encoding="utf-8")
    return root


def run(folder, *argv: str) -> int:
    return main(["prompt-cache", "--model", str(folder / "model"), "--threads", "1", "--quiet", *argv])


def test_text_document_saved_loaded_and_asked_twice(folder, tmp_path, capsys):
    out, report = tmp_path / "doc.safetensors", tmp_path / "doc.json"
    code = run(folder, "--text", str(folder / "doc.txt"), "--out", str(out), "--preset", "lean", "--chunk", "256",
               "--question", "Which colour is item 4?", "--question", "How many items?", "--max-new-tokens", "4",
               "--verify", "--json", str(report))
    printed = capsys.readouterr().out
    assert code == 0
    figures = json.loads(report.read_text())
    assert figures["file_bytes"] == out.stat().st_size and figures["tokens"] == len(DOCUMENT)
    assert [a["same_as_in_memory"] for a in figures["answers"]] == [True, True]
    assert all(len(a["answer_tokens"]) == 4 and a["load_s"] > 0 for a in figures["answers"])
    assert figures["meta"]["command"].startswith("hf-asymkv prompt-cache --model")
    assert "memory_footprint total" in printed and printed.count("sooner than the prefill") == 2
    meta = read_prompt_cache_metadata(out)
    assert meta["user"]["source"] == "doc.txt" and meta["user"]["preset"] == "lean"
    assert meta["cache_config"]["key_format"] == "int4"


def test_chat_messages_and_a_question_as_a_new_turn(folder, tmp_path, capsys):
    """The saved prompt is the rendered conversation; the question's tokens are the template's new user turn and
    the assistant's start, and the file loads for ids that continue it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "chat.safetensors"
    assert run(folder, "--messages", str(folder / "chat.json"), "--out", str(out), "--question", "Item 2?",
               "--max-new-tokens", "3", "--chunk", "0") == 0
    tokenizer = AutoTokenizer.from_pretrained(folder / "model")
    messages = json.loads((folder / "chat.json").read_text())
    full = tokenizer.apply_chat_template([*messages, {"role": "user", "content": "Item 2?"}], tokenize=True,
                                         add_generation_prompt=True, return_dict=False)
    config = AutoModelForCausalLM.from_pretrained(folder / "model").config
    cache = AsymKVCache.load(out, config, input_ids=torch.tensor([full]))
    assert cache.get_seq_length() == len(DOCUMENT) + len("<user>\n")
    assert "Q: Item 2?" in capsys.readouterr().out


def test_without_a_question_it_saves_and_reports_bytes(folder, tmp_path, capsys):
    out = tmp_path / "plain.safetensors"
    assert run(folder, "--text", str(folder / "doc.txt"), "--out", str(out), "--max-tokens", "100") == 0
    assert read_prompt_cache_metadata(out)["tokens"] == 100
    assert "bf16 DynamicCache file" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--messages", "doc.txt"], "is not JSON"),
    (["--messages", "list.json"], "must hold a non-empty JSON list"),
    (["--messages", "chat.json", "--max-tokens", "10"], "--max-tokens cuts a --text document"),
    (["--text", "missing.txt"], "--text: no such file or folder: 'missing.txt'"),
], ids=["not-json", "not-messages", "max-tokens-with-messages", "missing-text"])
def test_bad_inputs_are_refused_before_the_model_loads(folder, tmp_path, capsys, monkeypatch, argv, message):
    import hf_asymkv.models as models

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(models, "load_model", refuse)
    monkeypatch.chdir(folder)
    (folder / "list.json").write_text(json.dumps({"role": "user"}), encoding="utf-8")
    assert main(["prompt-cache", *argv, "--out", str(tmp_path / "x.safetensors")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x.safetensors").exists()


def test_a_template_that_refuses_a_second_user_turn_is_named(folder, tmp_path, capsys):
    """Templates that make roles alternate (Gemma's) raise on a question after a user turn: one line, exit 2."""
    from transformers import AutoTokenizer

    strict = tmp_path / "model"
    save_tiny_model(strict)
    tokenizer = AutoTokenizer.from_pretrained(strict)
    tokenizer.chat_template = ("{% for m in messages %}{% if loop.index0 % 2 and m['role'] == 'user' %}"
                               "{{ raise_exception('roles must alternate') }}{% endif %}{{ m['content'] }}{% endfor %}")
    tokenizer.save_pretrained(strict)
    code = main(["prompt-cache", "--model", str(strict), "--messages", str(folder / "chat.json"), "--question", "Q?",
                 "--out", str(tmp_path / "x.safetensors"), "--quiet"])
    assert code == 2 and "refuses the question as a new user turn" in capsys.readouterr().err

"""The needle grid in the forms of hf_asymkv.evals.forms: full precision answers as ``generate`` does in every form,
the question starts where the needle prompt's question line does, and the rows come scheme by scheme."""

from __future__ import annotations

import pytest
import torch
from helpers import char_tokenizer, greedy_with_logits
from transformers import DynamicCache

from hf_asymkv.evals.evaluate import encode_prompt, prompt_question_start
from hf_asymkv.evals.needle import make_task
from hf_asymkv.evals.retrieval import answer_prompt

pytestmark = pytest.mark.usefixtures("single_thread")

FORMS = ("tail", "one-pass", "question", "chunk100")


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


@pytest.fixture(scope="module")
def task(tok):
    return make_task(tok, "multikey", 600, 0.5, seed=3)


def test_question_starts_at_the_newline_before_the_question(tok, task):
    ids = encode_prompt(tok, task)
    start = prompt_question_start(tok, task, ids)
    assert tok.decode(ids[0, start:]).startswith("\nWhat is the special magic number for ")
    assert tok.decode(ids[0, :start]).endswith(task.messages[0]["content"].rsplit("\n", 1)[0])


@pytest.mark.parametrize("model", ["llama", "hybrid"], indirect=True)
def test_full_precision_answers_as_generate_in_every_form(model, tok, task):
    ids = encode_prompt(tok, task)
    sequences, _ = greedy_with_logits(model, ids, DynamicCache(config=model.config), task.max_new)
    expected = tok.decode(sequences[0, ids.shape[1]:], skip_special_tokens=True).strip()
    rows = answer_prompt(model, tok, task, ["dynamic", "asymkv-max"], 0, forms=FORMS, shared_chunk=150)
    assert [(r.scheme, r.form) for r in rows] == [
        ("dynamic", "tail"), ("dynamic@one-pass", "one-pass"), ("dynamic@question", "question"),
        ("dynamic@chunk100", "chunk100"), ("asymkv-max", "tail"), ("asymkv-max@one-pass", "one-pass"),
        ("asymkv-max@question", "question"), ("asymkv-max@chunk100", "chunk100")]
    assert {r.answer for r in rows[:4]} == {expected}
    assert all(r.same_as_full and r.tail_kl == 0.0 for r in rows[:4])
    assert rows[5].tail_kl == 0.0  # one-pass: the first answer token is drawn from the exact prefill
    assert rows[6].tail_kl > 0.0  # question: its forward reads the 1-bit values


def test_a_prompt_without_a_question_line_is_refused(tok, task):
    one_line = type(task)(**{**task.__dict__, "messages": [{"role": "user", "content": "no question here"}]})
    with pytest.raises(ValueError, match="cannot tell the question from the document"):
        prompt_question_start(tok, one_line, torch.ones(1, 20, dtype=torch.long))


def test_question_start_through_a_chat_template(task):
    chat = char_tokenizer()
    chat.chat_template = "{% for m in messages %}<{{ m.role }}>\n{{ m.content }}\n{% endfor %}<assistant>\n"
    ids = encode_prompt(chat, task)
    start = prompt_question_start(chat, task, ids)
    turn2 = chat.decode(ids[0, start:])
    assert turn2.startswith("\nWhat is the special magic number for ") and "\n<assistant>" in turn2
    assert turn2.endswith(task.answer_prefix)

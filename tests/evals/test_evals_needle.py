"""Retrieval prompt generators and scoring (hf_asymkv.evals.haystack / needle), with an offline character-level
tokenizer: needles land at the requested depth, distractors never answer the question, every expected value is
required, prompts fit their token budget, bad arguments raise ``ValueError``."""

from __future__ import annotations

import itertools
import random
import re

import pytest
from helpers import char_tokenizer

from hf_asymkv.evals.evaluate import encode_prompt
from hf_asymkv.evals.haystack import (
    NOISE_SENTENCES,
    builtin_text,
    haystack_stream,
    load_text,
    needle_sentence,
    split_sentences,
)
from hf_asymkv.evals.needle import (
    MAX_NEW,
    N_DISTRACTORS,
    N_VALUES,
    TASKS,
    make_task,
    score_task,
)

NEEDLE_RE = re.compile(r"One of the special magic numbers for (\S+) is: (\d+)\.")


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


def document(task) -> str:
    content = task.messages[0]["content"]
    return content.split("\n", 1)[1].rsplit("\n", 1)[0]


def planted(task) -> list[tuple[str, str, int]]:
    """(key, value, character offset) of every needle in the document."""
    return [(m.group(1), m.group(2), m.start()) for m in NEEDLE_RE.finditer(document(task))]


# ------------------------------------------------------------------------------------------------ scoring
def test_score_finds_the_answer(tok):
    task = make_task(tok, "single", 600, 0.5, seed=1)
    (value,) = task.answers
    assert score_task(f" {value}.", task) == (True, 1.0)
    assert score_task(f"The number is {value}, I think", task) == (True, 1.0)


def test_score_rejects_a_wrong_or_longer_number(tok):
    task = make_task(tok, "single", 600, 0.5, seed=1)
    (value,) = task.answers
    wrong = str(int(value) + 1) if value != "999999" else "100000"
    assert score_task(wrong, task) == (False, 0.0)
    assert score_task(value + "7", task) == (False, 0.0)  # 7 digits contain the 6 but are another number
    assert score_task("9" + value, task) == (False, 0.0)


def test_score_multikey_rejects_a_distractor_value(tok):
    task = make_task(tok, "multikey", 900, 0.5, seed=2)
    assert len(task.distractors) == N_DISTRACTORS
    assert score_task(task.answers[0], task) == (True, 1.0)
    assert score_task(task.distractors[0], task) == (False, 0.0)
    # listing every number found in the text is not an answer
    assert score_task(" ".join([task.answers[0], *task.distractors]), task) == (False, 1.0)


@pytest.mark.parametrize("name", ["multivalue", "multiquery"])
def test_score_requires_every_value(tok, name):
    task = make_task(tok, name, 900, 0.3, seed=3)
    assert len(task.answers) == N_VALUES
    first, second = task.answers
    assert score_task(f"{first} and {second}", task) == (True, 1.0)
    assert score_task(f"{second}, {first}.", task) == (True, 1.0)
    assert score_task(first, task) == (False, 0.5)


# ------------------------------------------------------------------------------------------------ generators
@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.75, 1.0])
@pytest.mark.parametrize("name", TASKS)
def test_needles_land_at_the_requested_depth(tok, name, depth):
    task = make_task(tok, name, 1500, depth, seed=4)
    doc = document(task)
    spans = [(m.start(), m.end() + 1, m.group(2)) for m in NEEDLE_RE.finditer(doc)]
    filler = len(doc) - sum(end - start for start, end, _ in spans)
    targets = [start - sum(e - s for s, e, _ in spans if e <= start) for start, _, v in spans if v in task.answers]
    assert len(targets) == len(task.answers)
    # depth = filler before the needle / all filler (character tokenizer: characters are tokens); the needle
    # sits at the sentence boundary nearest the requested depth, and a noise sentence is < 25 characters
    assert abs(targets[0] - depth * filler) <= 25, (targets[0], filler)
    assert targets[-1] - targets[0] <= 25 * (len(targets) - 1)  # the asked-for needles sit together


def test_multikey_distractors_differ_from_the_answer(tok):
    task = make_task(tok, "multikey", 900, 0.5, seed=5)
    needles = planted(task)
    assert len(needles) == 1 + N_DISTRACTORS
    target_key, target_value = task.key, task.answers[0]
    assert [k for k, _, _ in needles].count(target_key) == 1
    for key, value, _ in needles:
        if value != target_value:
            assert key != target_key and value in task.distractors
    assert len({v for _, v, _ in needles}) == len(needles)
    assert target_key in task.messages[0]["content"].rsplit("\n", 1)[1]  # the question asks the target key


def test_multivalue_one_key_several_values(tok):
    task = make_task(tok, "multivalue", 900, 0.5, seed=6)
    needles = planted(task)
    assert {k for k, _, _ in needles} == {task.key}
    assert sorted(v for _, v, _ in needles) == sorted(task.answers) and len(set(task.answers)) == N_VALUES


def test_multiquery_asks_for_every_key(tok):
    task = make_task(tok, "multiquery", 900, 0.5, seed=7)
    keys = [k for k, _, _ in planted(task)]
    question = task.messages[0]["content"].rsplit("\n", 1)[1]
    assert len(set(keys)) == N_VALUES and all(k in question for k in keys)
    assert all(k in task.answer_prefix for k in keys)


@pytest.mark.parametrize("length", [600, 800, 1000])
@pytest.mark.parametrize("name", TASKS)
def test_prompt_fits_the_budget(tok, name, length):
    task = make_task(tok, name, length, 0.4, seed=8)
    n = encode_prompt(tok, task).shape[1]
    assert n + MAX_NEW[name] <= length
    assert n + MAX_NEW[name] > length - 80  # filled, not just fitting (one sentence is < 60 characters)
    assert encode_prompt(tok, task).shape[1] == n  # deterministic


def test_seeds_are_reproducible_and_distinct(tok):
    a, b = make_task(tok, "multikey", 600, 0.5, seed=9), make_task(tok, "multikey", 600, 0.5, seed=9)
    c = make_task(tok, "multikey", 600, 0.5, seed=10)
    assert a == b
    assert a.answers != c.answers


def test_base_model_prompt_ends_with_the_answer_prefix(tok):
    task = make_task(tok, "single", 600, 0.5, seed=11)
    text = tok.decode(encode_prompt(tok, task)[0])
    assert text.endswith(f"\nAnswer: {task.answer_prefix}")


def test_chat_prompt_appends_the_answer_prefix_after_the_template(tok):
    chat = char_tokenizer()
    chat.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"
    task = make_task(chat, "single", 600, 0.5, seed=11)
    text = chat.decode(encode_prompt(chat, task)[0])
    assert text.startswith("<user>Some special magic numbers")
    assert text.endswith(f"<assistant> {task.answer_prefix}")


# ------------------------------------------------------------------------------------------------ haystacks
def test_noise_haystack_repeats_the_noise_passage(tok):
    task = make_task(tok, "single", 600, 0.5, seed=12, haystack="noise")
    rest = NEEDLE_RE.sub("", document(task))
    assert set(split_sentences(rest)) <= set(NOISE_SENTENCES)


def test_needle_haystack_distractors_never_answer(tok):
    task = make_task(tok, "single", 900, 0.5, seed=13, haystack="needles")
    needles = planted(task)
    assert len(needles) > 5
    others = [(k, v) for k, v, _ in needles if v not in task.answers]
    assert len(others) == len(needles) - 1
    assert all(k != task.key for k, _ in others)
    assert set(task.distractors) == {v for _, v in others}


def test_stream_avoids_the_given_keys_and_values():
    stream = haystack_stream("needles", random.Random(0), avoid=frozenset({"amber-falcon", "123456"}))
    for _ in range(3000):
        key, value = NEEDLE_RE.match(next(stream)).groups()
        assert key != "amber-falcon" and value != "123456"


def test_text_haystack_reads_the_file_in_order(tok, tmp_path):
    lines = [f"Sentence number {i} talks about the weather." for i in range(200)]
    path = tmp_path / "book.txt"
    path.write_text(" ".join(lines), encoding="utf-8")
    text, source = load_text(str(path))
    assert source == str(path)
    task = make_task(tok, "single", 900, 0.5, seed=14, haystack="text", sentences=split_sentences(text))
    found = [int(n) for n in re.findall(r"Sentence number (\d+)", document(task))]
    assert len(found) > 10
    assert all((b - a) % 200 == 1 for a, b in itertools.pairwise(found))  # consecutive, wrapping at the end


def test_builtin_text_is_long_and_stable():
    text, source = load_text(None)
    assert source == "builtin:pydoc_data.topics"
    assert text == builtin_text() and len(split_sentences(text)) > 1000


def test_split_sentences():
    assert split_sentences("One. Two!  Three?\n\nFour\nstill four.") == ["One.", "Two!", "Three?",
                                                                        "Four still four."]


def test_needle_sentence_wording():
    assert needle_sentence("a-b", "123456") == "One of the special magic numbers for a-b is: 123456."


# ------------------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize(("kwargs", "message"), [
    ({"task": "needle"}, r"task must be one of \['single', 'multikey', 'multivalue', 'multiquery'\], got 'needle'"),
    ({"depth": 1.5}, r"depth must be in \[0, 1\], got 1.5"),
    ({"depth": -0.1}, r"depth must be in \[0, 1\], got -0.1"),
    ({"length": 120}, r"length 120 is too short for task 'single'"),
    ({"haystack": "lorem"}, r"haystack must be one of \['noise', 'needles', 'text'\], got 'lorem'"),
    ({"haystack": "text"}, r"haystack 'text' needs the sentences"),
], ids=["task", "depth-high", "depth-low", "too-short", "haystack", "text-without-sentences"])
def test_bad_arguments(tok, kwargs, message):
    args = {"task": "single", "length": 600, "depth": 0.5, "haystack": "noise", **kwargs}
    with pytest.raises(ValueError, match=message):
        make_task(tok, args["task"], args["length"], args["depth"], haystack=args["haystack"])


def test_missing_or_short_text_file(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_text(str(tmp_path / "nope.txt"))
    (tmp_path / "short.txt").write_text("Only one sentence.", encoding="utf-8")
    with pytest.raises(ValueError, match="fewer than 20 sentences"):
        load_text(str(tmp_path / "short.txt"))

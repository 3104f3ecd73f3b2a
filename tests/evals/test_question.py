"""Finding the question after the document: the last line of the task's text, located in the rendered prompt, split
in tokens where the document's own encoding stops matching the prompt's."""

from __future__ import annotations

import pytest

from hf_asymkv.evals.question import MAX_STRADDLE, question_char, question_line, question_start


@pytest.mark.parametrize(("text", "line"), [("Intro\nDoc.\nWhat is it?", "What is it?"),
                                            ("Intro\nA\nB\nQ: x?\n", "Q: x?")], ids=["ruler", "trailing-newline"])
def test_question_line_is_the_last_line(text, line):
    assert question_line(text, "t") == line


@pytest.mark.parametrize(("text", "message"), [(None, "got NoneType"), ("one line", "got a single line"),
                                               ("doc\n   ", "blank")], ids=["none", "one-line", "blank"])
def test_question_line_refuses_texts_without_a_question(text, message):
    with pytest.raises(ValueError, match=message):
        question_line(text, "task 'x'")


def test_question_char_is_the_newline_before_the_last_occurrence():
    prompt = "<user>\nQ?\ndoc\nQ?\n<assistant> The answer is"
    assert question_char(prompt, "Q?", "t") == prompt.rindex("\nQ?")
    with pytest.raises(ValueError, match="not on a line of its own"):
        question_char(prompt, "Z?", "t")


@pytest.mark.parametrize(("prompt", "document", "start"), [
    ([1, 5, 6, 7, 8, 9], [1, 5, 6], 3),  # the document's tokens are the prompt's first ones
    ([1, 5, 6, 70, 8, 9], [1, 5, 6, 7], 3),  # its last token merged with the question's first inside the prompt
], ids=["clean", "straddle"])
def test_question_start_is_where_the_encodings_part(prompt, document, start):
    assert question_start(prompt, document, "t") == start


@pytest.mark.parametrize(("prompt", "document", "message"), [
    ([9, 5, 6, 7, 8], [1, 5, 6, 7], "match the prompt's first 0"),  # not the prompt's start: truncated on the left
    ([1, 5, 6], [1, 5, 6], "leaves an empty turn"),  # no question after the document
], ids=["truncated", "empty-question"])
def test_question_start_refuses_what_is_not_a_split(prompt, document, message):
    with pytest.raises(ValueError, match=message):
        question_start(prompt, document, "t")


def test_a_straddle_longer_than_allowed_is_refused():
    document = [1, 2, 3, 4, 5, 6]
    prompt = document[:len(document) - MAX_STRADDLE - 1] + [99, 98, 97, 96]
    with pytest.raises(ValueError, match="does not start with the document"):
        question_start(prompt, document, "t")

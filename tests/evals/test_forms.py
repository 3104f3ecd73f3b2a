"""The forms a prompt reaches a cache in (one-pass, the question reading the cache, a chunked prefill) give the
one-pass answers with ``DynamicCache``, and the quantized history is what the question form's question reads.

The reference is the true one-pass run: ``generate`` with a ``DynamicCache``, the prompt in one forward. The forms
regroup the same computation into several forwards (matrix products of other shapes sum in another order), so their
first-token logits equal it to float32 rounding (``assert_close``'s float32 tolerance), not bit for bit, and the
greedy tokens are the same."""

from __future__ import annotations

import pytest
import torch
from conftest import FIRST_PLAIN_TOKEN, VOCAB
from helpers import greedy_with_logits
from transformers import DynamicCache

from hf_asymkv.evals.forms import chunk_form, form_list, parse_variant, variant
from hf_asymkv.evals.scheme_decode import generate_per_scheme, prefilled_caches

pytestmark = pytest.mark.usefixtures("single_thread")

STEPS = 8
SPLIT = 260  # the "question" is the prompt's last 40 tokens
# Chunks shorter than the hybrid's 16-token window, between it and the split, and one that crosses the split.
FULL_FORMS = ["dynamic", "dynamic@question", "dynamic@chunk7", "dynamic@chunk64", "dynamic@chunk200"]


@pytest.fixture(scope="module")
def long_prompt() -> torch.Tensor:
    g = torch.Generator().manual_seed(11)
    return torch.randint(FIRST_PLAIN_TOKEN, VOCAB, (1, 300), generator=g)


@pytest.fixture(params=["llama", "hybrid"])
def one_pass(request, long_prompt):
    """``(model, generated ids [STEPS], first-token logits [1, vocab])`` of ``generate`` with a ``DynamicCache``."""
    model = request.getfixturevalue(request.param)
    sequences, logits = greedy_with_logits(model, long_prompt, DynamicCache(config=model.config), STEPS)
    return model, sequences[0, long_prompt.shape[1]:].tolist(), logits[0].float()


@pytest.mark.parametrize("shared_chunk", [None, 50], ids=["shared-one-forward", "shared-chunked"])
def test_every_form_gives_the_one_pass_answer_with_dynamic_cache(one_pass, long_prompt, shared_chunk):
    model, tokens, _ = one_pass
    answers = generate_per_scheme(model, long_prompt, FULL_FORMS, STEPS, split=SPLIT, shared_chunk=shared_chunk)
    assert answers == dict.fromkeys(FULL_FORMS, tokens)


@pytest.mark.parametrize("shared_chunk", [None, 50], ids=["shared-one-forward", "shared-chunked"])
def test_every_form_gives_the_one_pass_first_logits_with_dynamic_cache(one_pass, long_prompt, shared_chunk):
    model, _, first = one_pass
    got = {name: logits for name, _, logits in prefilled_caches(model, long_prompt, FULL_FORMS, SPLIT, shared_chunk)}
    assert sorted(got) == sorted(FULL_FORMS)
    for name, logits in got.items():
        torch.testing.assert_close(logits, first, msg=name)  # float32 tolerance: same sums in another order


def test_the_question_reads_the_quantized_document(hybrid, long_prompt):
    """One-pass: the first token's logits are full precision's (the prefill attends exact K/V); question and chunked
    forms: the question's forward reads the stored blocks, so with 1-bit values they move."""
    got = {name: logits for name, _, logits in prefilled_caches(
        hybrid, long_prompt, ["dynamic", "asymkv-max", "asymkv-max@question", "asymkv-max@chunk64"], SPLIT)}
    assert torch.equal(got["asymkv-max"], got["dynamic"])
    assert not torch.allclose(got["asymkv-max@question"], got["dynamic"], atol=1e-3)
    assert not torch.allclose(got["asymkv-max@chunk64"], got["dynamic"], atol=1e-3)


def test_the_question_form_needs_a_split(llama, long_prompt):
    with pytest.raises(ValueError, match=r"question's first token index in \[1, 299\], got None"):
        next(prefilled_caches(llama, long_prompt, ["dynamic@question"]))


def test_the_tail_form_is_the_needle_grids_own(llama, long_prompt):
    with pytest.raises(ValueError, match="needle grid's own"):
        next(prefilled_caches(llama, long_prompt, ["dynamic@tail"]))


@pytest.mark.parametrize(("scheme", "form", "name"), [("asymkv", "one-pass", "asymkv"),
                                                      ("asymkv", "question", "asymkv@question"),
                                                      ("kivi-2", chunk_form(512), "kivi-2@chunk512")],
                         ids=["one-pass", "question", "chunk"])
def test_variant_names_round_trip(scheme, form, name):
    assert variant(scheme, form) == name and parse_variant(name) == (scheme, form)


@pytest.mark.parametrize(("forms", "chunk", "message"), [(["bogus"], None, "unknown form"),
                                                         (["question", "question"], None, "repeated"),
                                                         ([], None, "no form"), (["one-pass"], 0, ">= 1 token")],
                         ids=["unknown", "repeated", "none", "chunk-0"])
def test_bad_form_lists_are_refused(forms, chunk, message):
    with pytest.raises(ValueError, match=message):
        form_list(forms, chunk)


def test_parse_variant_refuses_an_unknown_form():
    with pytest.raises(ValueError, match="unknown form 'chunk0'"):
        parse_variant("asymkv@chunk0")


def test_form_list_appends_the_chunked_form():
    assert form_list(["one-pass", "question"], 256) == ["one-pass", "question", "chunk256"]


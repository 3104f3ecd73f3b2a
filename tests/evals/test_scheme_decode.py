"""One shared prefill, every scheme: the answers and scores are those of ``generate`` with each scheme's own cache.

The prompt (300 tokens) is longer than every scheme's exact window (128), so every quantized scheme holds quantized
blocks when it decodes. All schemes run in one call, so a scheme that changed the shared prefill's tensors would
corrupt the ones after it."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import FIRST_PLAIN_TOKEN, VOCAB
from helpers import greedy_with_logits

from hf_asymkv.bench.schemes import make_cache, scheme_attention
from hf_asymkv.core.compat import cache_kwargs
from hf_asymkv.evals.common import schemes_for
from hf_asymkv.evals.scheme_decode import generate_per_scheme, prefilled_caches, score_per_scheme, shares_prefill

pytestmark = pytest.mark.usefixtures("single_thread")

STEPS = 10
# One scheme per kind of cache layer: plain, ours (presets differ in settings only; compact has wide key channels,
# max 1-bit values), ours under the fused attention, transformers' quanto and fp8 layers, KIVI, a per-token peer.
SCHEMES = ["dynamic", "asymkv-balanced", "asymkv-compact", "asymkv-max", "asymkv-balanced-fused", "hf-quanto-int4",
           "hf-fp8", "kivi-2", "vllm-int4-pth", "llama-q4_0", "asymkv-balanced-sliding", "asymkv-tight-sliding"]
SHARED = {"dynamic", "asymkv-balanced", "asymkv-compact", "asymkv-max", "hf-quanto-int4", "hf-fp8", "kivi-2",
          "asymkv-balanced-sliding", "asymkv-tight-sliding"}  # (quantized sliding layers: from a widened prefill)


@pytest.fixture(scope="module")
def long_prompt() -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.randint(FIRST_PLAIN_TOKEN, VOCAB, (1, 300), generator=g)


def _generate(model, ids, name: str):
    with scheme_attention(model, name):
        return greedy_with_logits(model, ids, make_cache(name, model.config), STEPS)


@pytest.fixture(params=["llama", "hybrid"])
def case(request, long_prompt):
    """``(model, schemes it can build, {scheme: (sequences, logits)} of generate)``."""
    model = request.getfixturevalue(request.param)
    usable, _ = schemes_for(model, SCHEMES)  # transformers' QuantizedCache refuses the hybrid's sliding layers
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model, usable, {name: _generate(model, long_prompt, name) for name in usable}


def test_answers_equal_generate_with_each_cache(case, long_prompt):
    model, usable, reference = case
    answers = generate_per_scheme(model, long_prompt, usable, STEPS)
    for name in usable:
        assert answers[name] == reference[name][0][0, long_prompt.shape[1]:].tolist(), name
    assert answers["asymkv-max"] != answers["dynamic"]  # the comparison can fail: quantized history changes tokens


def test_first_logits_are_the_prefill_of_generate(case, long_prompt):
    model, usable, reference = case
    for name, cache, logits in prefilled_caches(model, long_prompt, usable):
        torch.testing.assert_close(logits, reference[name][1][0].float(), rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("name", SCHEMES, ids=SCHEMES)
def test_which_schemes_share_the_prefill(llama, name):
    with scheme_attention(llama, name):
        assert shares_prefill(name, make_cache(name, llama.config)) == (name in SHARED)


def test_scores_equal_a_prefill_and_a_teacher_forced_continuation_per_cache(case, long_prompt):
    model, usable, _ = case
    context, continuation = long_prompt[:, :260], long_prompt[:, 260:]
    scores = score_per_scheme(model, context, continuation, usable)
    for name in usable:
        with scheme_attention(model, name), torch.no_grad():
            cache = make_cache(name, model.config)
            first = model(input_ids=context, **cache_kwargs(cache)).logits[0, -1:]
            tail = model(input_ids=continuation[:, :-1], **cache_kwargs(cache)).logits[0]
        logprobs = torch.cat([first, tail]).float().log_softmax(-1)
        expected = float(logprobs.gather(-1, continuation[0][:, None]).sum())
        assert scores[name][0] == pytest.approx(expected, rel=1e-5), name
        assert scores[name][1] is False  # a random model's argmax is not a random continuation


def test_stop_check_ends_each_answer_where_it_says(llama, long_prompt):
    made = []

    def stop():
        made.append(0)
        return lambda tokens: len(tokens) == 3

    answers = generate_per_scheme(llama, long_prompt, ["dynamic", "asymkv-balanced"], STEPS, stop=stop)
    assert [len(a) for a in answers.values()] == [3, 3] and len(made) == 2  # one fresh check per scheme


def test_eos_ends_an_answer_and_is_kept(llama, long_prompt):
    first = generate_per_scheme(llama, long_prompt, ["dynamic"], STEPS)["dynamic"]
    llama.generation_config.eos_token_id = first[4]
    try:
        got = generate_per_scheme(llama, long_prompt, ["dynamic"], STEPS)["dynamic"]
    finally:
        llama.generation_config.eos_token_id = None
    assert got == first[:first.index(first[4]) + 1]


@pytest.mark.parametrize(("shape", "steps", "message"), [((2, 8), 4, r"one prompt at a time"),
                                                         ((1, 8), 0, r"max_new_tokens must be >= 1, got 0")],
                         ids=["batch", "no-steps"])
def test_bad_requests_are_refused(llama, shape, steps, message):
    with pytest.raises(ValueError, match=message):
        generate_per_scheme(llama, torch.full(shape, FIRST_PLAIN_TOKEN), ["dynamic"], steps)


def test_an_empty_continuation_is_refused(llama):
    with pytest.raises(ValueError, match="non-empty continuation"):
        score_per_scheme(llama, torch.full((1, 8), FIRST_PLAIN_TOKEN), torch.zeros(1, 0, dtype=torch.long), ["dynamic"])

"""An lm-eval model whose every request runs through every cache scheme: lm-eval's HF wrapper, our decoding.

:class:`SchemeLM` is lm-eval's ``HFLM`` around an already loaded model, so that tokenization, BOS handling, chat
templates, stop sequences and the text handed to a task's scoring are lm-eval's own. It replaces the two methods
that run the model: ``generate_until`` answers each request greedily through every scheme from one shared prefill
(:func:`hf_asymkv.evals.scheme_decode.generate_per_scheme`), ``_loglikelihood_tokens`` scores each continuation the
same way (:func:`~hf_asymkv.evals.scheme_decode.score_per_scheme`). Answers are kept per (request, scheme) in a
:class:`~hf_asymkv.evals.lm_eval_store.ResponseStore`; lm-eval is then run once per scheme
(:attr:`SchemeLM.scheme`), and each run reads that scheme's answers: every scheme is scored by the task's own
code on the same samples, and the model runs each request once.

Greedy decoding only (a comparison of sampled answers between schemes measures the sampler); perplexity tasks
(``loglikelihood_rolling``) are refused: ``hf-asymkv eval ppl`` scores perplexity through the quantized history.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from lm_eval.models.huggingface import HFLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.models.utils_hf import stop_sequences_criteria

from ..models import input_device
from .forms import ONE_PASS, QUESTION, variant
from .lm_eval_store import ResponseStore, request_key
from .question import question_char, question_line, question_start
from .scheme_decode import generate_per_scheme, score_per_scheme

__all__ = ["SchemeLM", "answers_complete"]


def answers_complete(expected: list[str], text: str) -> bool:
    """Whether every expected answer is in ``text`` (case-insensitive): from then on RULER's ``string_match_all``
    scores the sample 1 whatever follows, since more text can only contain more."""
    return all(answer.lower() in text.lower() for answer in expected)


class SchemeLM(HFLM):
    """lm-eval model over ``model`` whose answers come from every scheme of ``schemes`` in every form of ``forms``;
    lm-eval reads those of :attr:`scheme` (a scheme name, ``<scheme>@<form>`` for forms other than one-pass).

    Args:
        model, tokenizer: a loaded causal LM and its tokenizer.
        schemes: scheme names, ``dynamic`` first (the shared prefill's reference).
        store: where answers are kept (and found again when a run is resumed).
        stop_when_scored: end a RULER answer as soon as every expected answer is in it (the sample's score can no
            longer change; see :func:`answers_complete`); requests without RULER's ``outputs`` run to the end.
        tick: called with where the run is, after every request and scheme.
        forms: how the prompt reaches each cache (:mod:`hf_asymkv.evals.forms`); generation requests only.
        shared_chunk: tokens per forward of the shared full-precision prefill (None: one forward).
    """

    def __init__(self, model, tokenizer, schemes: list[str], store: ResponseStore, stop_when_scored: bool = False,
                 tick: Callable[[str], None] | None = None, forms: tuple[str, ...] = (ONE_PASS,),
                 shared_chunk: int | None = None, **hflm_kwargs):
        super().__init__(pretrained=model, tokenizer=tokenizer, batch_size=1, **hflm_kwargs)
        self.schemes, self.store, self.stop_when_scored, self.tick = schemes, store, stop_when_scored, tick
        self.forms, self.shared_chunk = tuple(forms), shared_chunk
        self.variants = [variant(s, f) for f in self.forms for s in schemes]
        self.scheme = schemes[0]

    # ------------------------------------------------------------------------------------------ generation
    def _stop_check(self, until: list[str], expected: list[str] | None):
        """A fresh check for one scheme's answer: a stop sequence (lm-eval's own criteria), or, with
        ``stop_when_scored`` and RULER's expected answers, all of them in the text lm-eval would score."""
        criteria = stop_sequences_criteria(self.tokenizer, until, 0, 1)

        def check(tokens: list[int]) -> bool:
            if bool(criteria(torch.tensor([tokens]), None).all()):
                return True
            return expected is not None and answers_complete(expected, self._answer_text(tokens, until))
        return check

    def _answer_text(self, tokens: list[int], until: list[str]) -> str:
        """What lm-eval's ``HFLM.generate_until`` returns for these generated tokens."""
        return postprocess_generated_text(self.tok_decode(tokens), until, self.think_end_token)

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        eos = self.tok_decode(self.eot_token_id, skip_special_tokens=False)
        answers = []
        for n, request in enumerate(requests, 1):
            context, gen_kwargs = request.args
            kwargs = normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks)
            if kwargs.get("do_sample"):
                raise ValueError(f"task {request.task_name!r} samples (do_sample=True): only greedy answers are "
                                 "compared between schemes")
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_new = kwargs.pop("max_gen_toks")
            expected = request.doc.get("outputs") if self.stop_when_scored and isinstance(request.doc, dict) else None
            key = request_key("generate_until", context, until, max_new, expected is not None)
            if missing := self.store.missing(key, self.variants):
                ids, _ = self.tok_batch_encode([context], left_truncate_len=self.max_length - max_new,
                                               truncation=self.truncation)
                where = f"{request.task_name} request {n}/{len(requests)}"
                split = self._question_start(request, context, ids, max_new) if any(
                    v.endswith(f"@{QUESTION}") for v in missing) else None
                start, cpu = time.perf_counter(), time.process_time()
                tokens = generate_per_scheme(self.model, ids.to(input_device(self.model)), missing, max_new,
                                             stop=lambda: self._stop_check(until, expected),
                                             tick=self.tick and (lambda s, where=where: self.tick(f"{where}, {s}")),
                                             split=split, shared_chunk=self.shared_chunk)
                self.store.add(key, request, {s: {"text": self._answer_text(t, until), "tokens": len(t)}
                                              for s, t in tokens.items()},
                               {"prompt_tokens": ids.shape[1], "question_tokens": ids.shape[1] - split if split else None,
                                "seconds": round(time.perf_counter() - start, 1),
                                "cpu_seconds": round(time.process_time() - cpu, 1)})
            answers.append(self.store.get(key, self.scheme)["text"])
        return answers

    def _question_start(self, request, context: str, ids: torch.Tensor, max_new: int) -> int:
        """Index in ``ids`` ``[1, T]`` (``context`` encoded) of the question's first token: the newline before the
        last line of the task's text (RULER's ``input``), found as :mod:`hf_asymkv.evals.question` says."""
        where = f"task {request.task_name!r}, document {request.doc_id}"
        doc = request.doc if isinstance(request.doc, dict) else {}
        at = question_char(context, question_line(doc.get("input"), where), where)
        document, _ = self.tok_batch_encode([context[:at]], left_truncate_len=self.max_length - max_new,
                                            truncation=self.truncation)
        return question_start(ids[0].tolist(), document[0].tolist(), where)

    # ------------------------------------------------------------------------------------------ likelihood
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs=None):
        device = input_device(self.model)
        scores = []
        for (context, continuation), context_enc, continuation_enc in requests:
            # HFLM's truncation: the last max_length + 1 tokens of context + continuation (the final one is only
            # a target)
            whole = (context_enc + continuation_enc)[-(self.max_length + 1):]
            n = len(continuation_enc)
            if n == 0 or len(whole) <= n:
                raise ValueError(f"continuation of {n} tokens leaves no context within max_length {self.max_length}")
            key = request_key("loglikelihood", whole, n)
            if missing := self.store.missing(key, self.schemes):
                got = score_per_scheme(self.model, torch.tensor([whole[:-n]], device=device),
                                       torch.tensor([whole[-n:]], device=device), missing)
                self.store.add(key, None, {s: {"logprob": lp, "greedy": greedy} for s, (lp, greedy) in got.items()})
            found = self.store.get(key, self.scheme)
            scores.append((found["logprob"], found["greedy"]))
        return scores

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        raise ValueError("perplexity tasks (loglikelihood_rolling) are not compared here: `hf-asymkv eval ppl` "
                         "scores perplexity through each scheme's quantized history")

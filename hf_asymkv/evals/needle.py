"""RULER-style retrieval prompts, generated offline, and their string-match scoring.

Four tasks, each planting needles ("One of the special magic numbers for <key> is: <value>.") in a haystack
(:mod:`.haystack`) and asking for them at the end:

- ``single``: one needle, one question.
- ``multikey``: the needle plus :data:`N_DISTRACTORS` needles with other keys (and other values) at random
  depths; answering a distractor's value is wrong.
- ``multivalue``: :data:`N_VALUES` needles with the same key and different values; all are required.
- ``multiquery``: :data:`N_VALUES` needles with different keys, the question asks for all of them.

The needles asked about sit at the requested depth (0 = start of the document, 1 = end, measured in
tokens), one filler sentence apart. ``length`` is RULER's budget: the prompt plus the answer's
``max_new`` tokens fit in ``length`` tokens. The prompt ends with the start of the answer ("The special
magic number for <key> mentioned in the provided text is"), for chat and base models alike, so that the
answer is the value itself and a few greedy tokens suffice.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from .haystack import haystack_stream, needle_sentence, random_key, random_value
from .tasks import score_answer

__all__ = ["MAX_NEW", "N_DISTRACTORS", "N_VALUES", "TASKS", "Needle", "NeedleTask", "make_task", "score_task"]

TASKS = ("single", "multikey", "multivalue", "multiquery")
N_DISTRACTORS = 3  # multikey: needles with other keys
N_VALUES = 2  # multivalue / multiquery: needles the answer must list
MAX_NEW = {"single": 12, "multikey": 12, "multivalue": 24, "multiquery": 24}  # tokens: 6 digits each + glue

_INTRO = ("Some special magic numbers are hidden within the following text. Make sure to memorize them. "
          "I will quiz you about the numbers afterwards.")
_NEEDLE_RE = re.compile(r"special magic numbers for (\S+) is: (\d+)\.")


@dataclass(frozen=True)
class Needle:
    """One planted fact; ``target`` when the question asks for it."""

    key: str
    value: str
    target: bool


@dataclass(frozen=True)
class NeedleTask:
    """A retrieval prompt and what a correct answer contains.

    ``answers`` must all appear in the answer, ``distractors`` (values of needles not asked for) must not.
    ``messages`` is the chat form; :func:`hf_asymkv.evals.evaluate.encode_prompt` appends ``answer_prefix``.
    """

    task: str
    haystack: str
    messages: list[dict]
    answer_prefix: str
    key: str
    answers: tuple[str, ...]
    distractors: tuple[str, ...]
    needles: tuple[Needle, ...]
    depth: float
    length: int
    seed: int
    max_new: int


def _needles(task: str, rng: random.Random) -> list[Needle]:
    """The planted needles of ``task``, targets first; keys and values all distinct."""
    keys, values = [], []
    while len(keys) < 1 + N_DISTRACTORS:
        key = random_key(rng)
        if key not in keys:
            keys.append(key)
    while len(values) < 1 + N_DISTRACTORS:
        value = random_value(rng)
        if value not in values:
            values.append(value)
    if task == "single":
        return [Needle(keys[0], values[0], True)]
    if task == "multikey":
        return [Needle(keys[0], values[0], True)] + [Needle(k, v, False) for k, v in zip(keys[1:], values[1:])]
    if task == "multivalue":
        return [Needle(keys[0], v, True) for v in values[:N_VALUES]]
    return [Needle(k, v, True) for k, v in zip(keys[:N_VALUES], values[:N_VALUES])]


def _question(task: str, keys: list[str]) -> tuple[str, str]:
    """``(question, answer prefix)`` for the target keys."""
    if task in ("single", "multikey"):
        return (f"What is the special magic number for {keys[0]} mentioned in the provided text?",
                f"The special magic number for {keys[0]} mentioned in the provided text is")
    if task == "multivalue":
        return (f"What are all the special magic numbers for {keys[0]} mentioned in the provided text?",
                f"The special magic numbers for {keys[0]} mentioned in the provided text are")
    both = " and ".join(keys)
    return (f"What are all the special magic numbers for {both} mentioned in the provided text?",
            f"The special magic numbers for {both} mentioned in the provided text are")


def _sentence_tokens(tokenizer, sentences: list[str]) -> list[int]:
    """Token count of each sentence as it appears inside the document (after a space)."""
    enc = tokenizer([" " + s for s in sentences], add_special_tokens=False)["input_ids"]
    return [len(ids) for ids in enc]


def _fill(tokenizer, stream, budget: int) -> tuple[list[str], list[int]]:
    """Filler sentences from ``stream`` until their tokens reach ``budget``; with each one's token count."""
    sentences: list[str] = []
    counts: list[int] = []
    while sum(counts) < budget:
        batch = [next(stream) for _ in range(256)]
        sentences += batch
        counts += _sentence_tokens(tokenizer, batch)
    return sentences, counts


def _document(filler: list[str], counts: list[int], needles: list[Needle], depth: float,
              rng: random.Random) -> str:
    """The filler with the targets at ``depth`` (one sentence apart) and the other needles at random depths."""
    cum = [0]
    for c in counts:
        cum.append(cum[-1] + c)

    def slot(d: float) -> int:  # sentence boundary whose token offset is nearest to d of the document
        return min(range(len(cum)), key=lambda i: abs(cum[i] - d * cum[-1]))

    at: dict[int, list[str]] = {}
    base = slot(depth)
    for j, n in enumerate(x for x in needles if x.target):
        at.setdefault(min(base + j, len(filler)), []).append(needle_sentence(n.key, n.value))
    for n in needles:
        if not n.target:
            at.setdefault(slot(rng.random()), []).append(needle_sentence(n.key, n.value))
    parts: list[str] = []
    for i in range(len(filler) + 1):
        parts += at.get(i, [])
        if i < len(filler):
            parts.append(filler[i])
    return " ".join(parts)


def _build(task: str, haystack: str, document: str, needles: list[Needle], depth: float, length: int, seed: int,
           max_new: int) -> NeedleTask:
    targets = [n for n in needles if n.target]
    keys = list(dict.fromkeys(n.key for n in targets))
    question, prefix = _question(task, keys)
    messages = [{"role": "user", "content": f"{_INTRO}\n{document}\n{question}"}]
    answers = tuple(n.value for n in targets)
    planted = {m.group(2) for m in _NEEDLE_RE.finditer(document)}
    distractors = tuple(sorted(planted - set(answers)))
    return NeedleTask(task, haystack, messages, prefix, keys[0], answers, distractors, tuple(needles), depth,
                      length, seed, max_new)


def make_task(tokenizer, task: str, length: int, depth: float, seed: int = 0, haystack: str = "noise",
              sentences: list[str] | None = None) -> NeedleTask:
    """Build one retrieval prompt whose encoded form plus the answer budget fits in ``length`` tokens.

    Args:
        tokenizer: the model's tokenizer (sizes the haystack; chat template used when it has one).
        task: one of :data:`TASKS`.
        length: total token budget (prompt + :data:`MAX_NEW` ``[task]`` answer tokens).
        depth: where the asked-for needles sit, 0.0 (start) .. 1.0 (end).
        seed: with task, haystack, length and depth, decides keys, values, distractors and filler.
        haystack: ``noise``, ``needles`` or ``text`` (then ``sentences`` is the split natural text).

    Raises:
        ValueError: unknown task, depth outside [0, 1], or a length too short for the question.
    """
    from .evaluate import encode_prompt  # torch: imported here so that the CLI reads TASKS without it

    if task not in TASKS:
        raise ValueError(f"task must be one of {list(TASKS)}, got {task!r}")
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth!r}")
    rng = random.Random(f"{task}/{haystack}/{length}/{depth}/{seed}")
    needles = _needles(task, rng)
    max_new = MAX_NEW[task]
    avoid = frozenset(x for n in needles for x in (n.key, n.value))
    stream = haystack_stream(haystack, random.Random(rng.random()), sentences, avoid)
    empty = _build(task, haystack, _document([], [], needles, depth, random.Random(0)), needles, depth, length,
                   seed, max_new)
    budget = length - max_new - len(encode_prompt(tokenizer, empty)[0])
    if budget < 32:
        raise ValueError(f"length {length} is too short for task {task!r}: the question and needles alone "
                         f"need {length - budget} tokens (including {max_new} answer tokens)")
    filler, counts = _fill(tokenizer, stream, budget)
    place_seed = rng.random()
    while True:  # per-sentence counts are an estimate: trim until the encoded prompt fits
        keep, total = 0, 0
        while keep < len(counts) and total + counts[keep] <= budget:
            total += counts[keep]
            keep += 1
        document = _document(filler[:keep], counts[:keep], needles, depth, random.Random(place_seed))
        built = _build(task, haystack, document, needles, depth, length, seed, max_new)
        excess = len(encode_prompt(tokenizer, built)[0]) + max_new - length
        if excess <= 0:
            return built
        budget -= excess


def score_task(answer_text: str, task: NeedleTask) -> tuple[bool, float]:
    """``(correct, recall)``: correct when every expected value and no distractor value appears (whole numbers:
    ``1234567`` does not contain ``123456``); recall is the fraction of expected values found."""
    found = [score_answer(answer_text, v) for v in task.answers]
    wrong = any(score_answer(answer_text, v) for v in task.distractors)
    return all(found) and not wrong, sum(found) / len(found)

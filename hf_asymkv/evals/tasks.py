"""Offline long-document retrieval prompts (a needle in a haystack), built without any download.

A fact ("The access code for <key> is <value>.") is planted at a chosen depth of a haystack made of varied
filler sentences, then asked for at the end. Scoring is a string match of the value in the answer.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

__all__ = ["NeedlePrompt", "make_needle_prompt", "noise_haystack", "score_answer"]

_SUBJECTS = ["The river", "A quiet village", "The old library", "The mountain road", "A small bakery", "The harbor",
             "The museum", "A long train", "The garden", "The observatory", "A wooden bridge", "The market"]
_VERBS = ["stood near", "looked over", "was known for", "opened onto", "was built beside", "stretched past",
          "was painted like", "was quiet during", "smelled of", "was busy with"]
_OBJECTS = ["the autumn fields", "a row of lanterns", "the morning fog", "the fishing boats", "a field of barley",
            "the evening bells", "a crowd of travellers", "the winter market", "the northern hills", "fresh bread"]
_KEYS = ["blue vault", "north gate", "river archive", "copper locker", "east tower", "glass door", "old safe",
         "red cabinet", "west wing", "iron chest"]


@dataclass(frozen=True)
class NeedlePrompt:
    """A retrieval prompt: ``messages`` for a chat template, the planted ``answer`` and where it sits."""

    messages: list[dict]
    answer: str
    key: str
    depth: float
    context_tokens: int


def noise_haystack(rng: random.Random, n_sentences: int) -> list[str]:
    """Varied but meaningless filler sentences (so that nothing in them answers the question)."""
    return [f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}." for _ in range(n_sentences)]


def make_needle_prompt(tokenizer, context_tokens: int, depth: float = 0.5, seed: int = 0) -> NeedlePrompt:
    """Build a single-needle prompt whose document is about ``context_tokens`` tokens long.

    Args:
        tokenizer: the model's tokenizer (used to size the haystack).
        context_tokens: target length of the document in tokens.
        depth: where the needle sits, 0.0 (start) .. 1.0 (end).
        seed: chooses filler, key and the 4-digit value.
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth!r}.")
    if context_tokens < 64:
        raise ValueError(f"context_tokens must be >= 64, got {context_tokens!r}.")
    rng = random.Random(seed)
    key, value = rng.choice(_KEYS), str(rng.randint(1000, 9999))
    needle = f"The access code for the {key} is {value}."
    per_sentence = max(1, len(tokenizer(" ".join(noise_haystack(random.Random(seed), 50)))["input_ids"]) / 50)
    sentences = noise_haystack(rng, max(1, int(context_tokens / per_sentence)))
    sentences.insert(int(round(depth * len(sentences))), needle)
    document = " ".join(sentences)
    question = f"What is the access code for the {key}? Answer with the number only."
    messages = [{"role": "user", "content": f"Read the document and answer the question.\n\n{document}\n\n{question}"}]
    return NeedlePrompt(messages, value, key, depth, context_tokens)


def score_answer(answer_text: str, expected: str) -> bool:
    """True when ``expected`` appears in the answer as a whole token (``41720`` does not match ``4172``)."""
    import re

    return re.search(rf"(?<!\d){re.escape(expected)}(?!\d)", answer_text) is not None

"""Filler text for long prompts, built offline: repeated noise, distractor needles, or natural text from a file.

Each haystack is an endless stream of sentences, seeded, so that a prompt of any length is reproducible:

- ``noise``: RULER's repeated noise passage ("The grass is green. The sky is blue. ...").
- ``needles``: distractor needles only ("One of the special magic numbers for <key> is: <value>."), each with
  a key the question does not ask for; a model that grabs any number-shaped fact fails.
- ``text``: sentences of a local text file (``--haystack-file``), read in order from a seeded start, wrapping.
  Without a file, the built-in corpus: the English prose of Python's own documentation topics
  (``pydoc_data.topics``, shipped with every CPython, so it exists offline and is identical for one Python
  version).
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from pathlib import Path

__all__ = [
    "HAYSTACKS",
    "NOISE_SENTENCES",
    "builtin_text",
    "haystack_stream",
    "load_text",
    "needle_sentence",
    "random_key",
    "random_value",
    "split_sentences",
]

HAYSTACKS = ("noise", "needles", "text")
NOISE_SENTENCES = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.",
                   "There and back again.")
BUILTIN_TEXT_NAME = "builtin:pydoc_data.topics"

_ADJECTIVES = ("amber", "brisk", "calm", "dusty", "eager", "faint", "gentle", "hollow", "icy", "jolly", "keen",
               "lofty", "misty", "noble", "olive", "proud", "quiet", "rusty", "silver", "tidy", "upper", "vivid",
               "woolen", "young", "zesty", "bold", "crisp", "dim", "fuzzy", "grand")
_NOUNS = ("falcon", "lantern", "meadow", "harbor", "violin", "comet", "garden", "pebble", "castle", "river",
          "orchid", "tunnel", "beacon", "walrus", "saddle", "teapot", "glacier", "ribbon", "canyon", "parrot",
          "anchor", "thimble", "cactus", "ladder", "kettle", "quarry", "lizard", "marble", "nectar", "island")


def random_key(rng: random.Random) -> str:
    """A two-word key such as ``"misty-harbor"`` (900 possible keys)."""
    return f"{rng.choice(_ADJECTIVES)}-{rng.choice(_NOUNS)}"


def random_value(rng: random.Random) -> str:
    """A 6-digit value with no leading zero."""
    return str(rng.randint(100000, 999999))


def needle_sentence(key: str, value: str) -> str:
    """The fact a needle plants (RULER's wording)."""
    return f"One of the special magic numbers for {key} is: {value}."


def builtin_text() -> str:
    """The built-in natural-text corpus: every ``pydoc_data.topics`` entry, in sorted topic order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics))


def load_text(path: str | None) -> tuple[str, str]:
    """``(text, source name)`` of a UTF-8 text file, or of the built-in corpus when ``path`` is None.

    Raises:
        ValueError: the file is missing, unreadable as UTF-8, or holds fewer than 20 sentences.
    """
    if path is None:
        return builtin_text(), BUILTIN_TEXT_NAME
    file = Path(path).expanduser()
    if not file.is_file():
        raise ValueError(f"haystack/text file {str(path)!r} does not exist or is not a file")
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"text file {str(path)!r} is not UTF-8 text: {exc}") from None
    if len(split_sentences(text)) < 20:
        raise ValueError(f"text file {str(path)!r} holds fewer than 20 sentences; give a longer text")
    return text, str(file)


def split_sentences(text: str) -> list[str]:
    """Whitespace-normalized sentences: split after ``.``/``!``/``?`` followed by a space, or at blank lines."""
    parts = re.split(r"(?<=[.!?])\s+|\n\s*\n", text)
    return [" ".join(p.split()) for p in parts if p and p.strip()]


def haystack_stream(kind: str, rng: random.Random, sentences: list[str] | None = None,
                    avoid: frozenset[str] = frozenset()) -> Iterator[str]:
    """Endless filler sentences of one haystack ``kind`` (see the module docstring).

    Args:
        kind: one of :data:`HAYSTACKS`.
        rng: seeded; decides the text start and the distractor keys/values.
        sentences: the natural text, split (``kind="text"`` only).
        avoid: keys and values distractor needles must not use (the ones the question asks about or
            expects), so a distractor never answers the question.

    Raises:
        ValueError: unknown kind, or ``text`` without sentences.
    """
    if kind not in HAYSTACKS:
        raise ValueError(f"haystack must be one of {list(HAYSTACKS)}, got {kind!r}")
    if kind == "noise":
        while True:
            yield from NOISE_SENTENCES
    if kind == "needles":
        while True:
            key, value = random_key(rng), random_value(rng)
            if key not in avoid and value not in avoid:
                yield needle_sentence(key, value)
    if not sentences:
        raise ValueError("haystack 'text' needs the sentences of a text (load_text + split_sentences)")
    i = rng.randrange(len(sentences))
    while True:
        yield sentences[i % len(sentences)]
        i += 1

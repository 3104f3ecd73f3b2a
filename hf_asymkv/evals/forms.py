"""How a prompt reaches a scheme's cache: the forms an evaluation runs, and the names of (scheme, form) pairs.

- ``one-pass``: the prompt in one prefill. The prefill hands the attention the exact K/V, so the question attends
  the document at full precision and only the answer's later tokens read what the cache stores: ``generate``'s
  case, and the mildest.
- ``question`` (the question reads the cache): the document is prefilled as turn 1, then what follows it (the
  question, the end of the turn, the answer's prefix: :mod:`.question`) goes through the scheme's cache as turn 2,
  so the question's own forward reads the stored document. A follow-up question on a cached document, a prompt
  cache loaded from disk.
- ``chunk<N>`` (chunked prefill, ``--prefill-chunk N``): the whole prompt through the scheme's cache in forwards of
  ``N`` tokens; every chunk after the first reads the stored history. A long prompt prefilled to bound memory.
- ``tail`` (the needle grid's own form, :mod:`.retrieval`): the prompt's last 16 tokens through the cache.

With ``DynamicCache`` every form gives the one-pass answers (``tests/evals/test_forms.py``). A scheme's answers in a
form other than one-pass are kept under ``<scheme>@<form>`` (:func:`variant`); one-pass keeps the bare scheme name,
so response files written before forms existed are read as one-pass answers.
"""

from __future__ import annotations

__all__ = ["FORMS", "ONE_PASS", "QUESTION", "TAIL_FORM", "chunk_form", "form_chunk", "form_list", "parse_variant",
           "variant"]

ONE_PASS = "one-pass"
QUESTION = "question"
TAIL_FORM = "tail"
FORMS = (ONE_PASS, QUESTION)
"""Forms named on the command line (``--forms``); the chunked form is ``--prefill-chunk N``."""

_CHUNK = "chunk"


def chunk_form(tokens: int) -> str:
    """The chunked-prefill form of ``tokens`` tokens per forward (``"chunk512"``).

    Raises:
        ValueError: ``tokens`` < 1.
    """
    if tokens < 1:
        raise ValueError(f"--prefill-chunk must be >= 1 token, got {tokens}")
    return f"{_CHUNK}{tokens}"


def form_chunk(form: str) -> int | None:
    """Tokens per forward of a chunked form; None for the other forms."""
    digits = form.removeprefix(_CHUNK)
    return int(digits) if form.startswith(_CHUNK) and digits.isdigit() and int(digits) >= 1 else None


def form_list(forms: list[str], prefill_chunk: int | None = None, known: tuple[str, ...] = FORMS) -> list[str]:
    """The forms a run answers in: ``forms`` (names of ``known``, in the given order), then the chunked form of
    ``prefill_chunk`` when given.

    Raises:
        ValueError: an unknown or repeated form, no form at all, or ``prefill_chunk`` < 1.
    """
    bad = [f for f in forms if f not in known]
    if bad:
        raise ValueError(f"unknown form(s) {bad}; forms: {list(known)} (the chunked form is --prefill-chunk N)")
    if len(set(forms)) != len(forms):
        raise ValueError(f"forms repeated in {forms}")
    out = [*forms, *([chunk_form(prefill_chunk)] if prefill_chunk is not None else [])]
    if not out:
        raise ValueError("no form to answer in: give --forms or --prefill-chunk")
    return out


def variant(scheme: str, form: str, plain: str = ONE_PASS) -> str:
    """The name a scheme's answers in ``form`` are kept under: the scheme itself for the ``plain`` form (one-pass;
    the needle grid's tables: tail), else ``<scheme>@<form>``."""
    return scheme if form == plain else f"{scheme}@{form}"


def parse_variant(name: str) -> tuple[str, str]:
    """``(scheme, form)`` of a name made by :func:`variant`.

    Raises:
        ValueError: a form that is neither one of :data:`FORMS`, ``tail`` nor a chunked form.
    """
    scheme, _, form = name.partition("@")
    form = form or ONE_PASS
    if form not in (*FORMS, TAIL_FORM) and form_chunk(form) is None:
        raise ValueError(f"{name!r}: unknown form {form!r}; forms: {[*FORMS, TAIL_FORM, 'chunk<N>']}")
    return scheme, form

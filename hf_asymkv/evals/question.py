"""Where a long prompt's question starts: the split between the document (turn 1) and what follows it (turn 2).

A retrieval prompt is a document followed by a question about it: RULER's templates end with
``"...\\n{context}\\nWhat are all the special magic numbers for {query} mentioned in the provided text?"`` (its
variable-tracking, word-count and QA templates likewise put ``Question: ...`` on the last line), and our needle
prompts (:mod:`.needle`) end with ``"\\n{question}"``. So the question is the last line of the task's text, and
what follows the document in the rendered prompt starts at the newline before that line: the question, the
chat template's end of turn and the answer's prefix, whatever the template adds.

The split is found in tokens without trusting that the text before the question tokenizes alone as it does inside
the prompt: the document part is encoded by itself and the split is where its tokens stop matching the prompt's
(a token that straddles the newline stays with the document). When the two disagree by more than that, the split
is refused rather than guessed.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["MAX_STRADDLE", "question_char", "question_line", "question_start"]

MAX_STRADDLE = 2
"""Tokens at the document's end that may encode differently alone than inside the whole prompt (a token merged
across the split); a larger mismatch means the document text is not the prompt's beginning."""


def question_line(text: str | None, where: str) -> str:
    """The last line of a task's text (its question); ``where`` names the task in the error.

    Raises:
        ValueError: no text, a text of one line (no document before a question) or an empty last line.
    """
    if not isinstance(text, str) or "\n" not in text.rstrip("\n"):
        raise ValueError(f"{where}: cannot tell the question from the document: the question-reads-cache form needs "
                         "a text whose last line is the question after the document (RULER's 'input'); got "
                         f"{type(text).__name__ if not isinstance(text, str) else 'a single line'}")
    line = text.rstrip("\n").rsplit("\n", 1)[1]
    if not line.strip():
        raise ValueError(f"{where}: the text's last line is blank: no question to split at")
    return line


def question_char(prompt: str, line: str, where: str) -> int:
    """Character offset in the rendered ``prompt`` of the newline before its last occurrence of ``line``.

    Raises:
        ValueError: ``line`` does not follow a newline anywhere in ``prompt``.
    """
    at = prompt.rfind("\n" + line)
    if at <= 0:
        raise ValueError(f"{where}: the question {line[:80]!r} is not on a line of its own in the prompt, so the "
                         "document before it cannot be separated")
    return at


def question_start(prompt_ids: Sequence[int], document_ids: Sequence[int], where: str) -> int:
    """Index of the first token of turn 2 in ``prompt_ids``, given ``document_ids``: the prompt text before the
    question encoded by itself (same tokenizer settings).

    Returns:
        The number of leading tokens both encodings share: in ``[1, len(prompt_ids) - 1]``.

    Raises:
        ValueError: the encodings part more than :data:`MAX_STRADDLE` tokens before the document's end (the
            document is not the prompt's start, e.g. a left-truncated prompt), or the split leaves either turn empty.
    """
    n = min(len(prompt_ids), len(document_ids))
    shared = next((i for i in range(n) if prompt_ids[i] != document_ids[i]), n)
    if shared < len(document_ids) - MAX_STRADDLE:
        raise ValueError(f"{where}: the document's {len(document_ids)} tokens match the prompt's first "
                         f"{shared} only: the prompt does not start with the document (truncated?), so the "
                         "question's tokens cannot be found")
    if not 1 <= shared < len(prompt_ids):
        raise ValueError(f"{where}: splitting {len(prompt_ids)} prompt tokens at {shared} leaves an empty turn")
    return shared

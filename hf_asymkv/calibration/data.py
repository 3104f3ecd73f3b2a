"""Calibration text: local files (or folders of them) or a `datasets` name, tokenized and packed into
fixed-length samples.

Plain text (``.txt``, ``.md``, files without a suffix) is read directly, one document per file, so calibrating on
a text file needs nothing beyond the core install. Structured files (``.jsonl``/``.json``/``.parquet``) and Hub
dataset names are read through the `datasets` library (``pip install "hf-asymkv[calibrate]"``), streamed: rows
are parsed only as far as the samples need them, and nothing is converted into `datasets`' Arrow cache.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch loads in pack_samples: the CLI checks --data paths with this module before any import
    import torch

__all__ = ["DEFAULT_NUM_SAMPLES", "DEFAULT_SEQ_LEN", "MIN_TEXT_TOKENS", "SamplePlan", "cut_samples", "iter_texts",
           "load_texts", "looks_like_path", "pack_samples", "plan_samples", "read_tokens", "stream_texts"]

_TEXT_SUFFIXES = (".txt", ".md")
_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}  # suffix -> `datasets` packaged builder
_SUFFIXES = _TEXT_SUFFIXES + tuple(_BUILDERS)
INSTALL_HINT = 'pip install "hf-asymkv[calibrate]"'


def _import_datasets(why: str):
    try:
        import datasets
    except ImportError:
        raise ValueError(f"{why} needs the `datasets` package: {INSTALL_HINT} (or pip install datasets)") from None
    datasets.disable_progress_bars()  # our own progress bar reports the calibration
    return datasets


@contextmanager
def _raised_not_logged():
    """`datasets` logs a file's parse error before raising it; we raise it once, naming the file, so the CLI
    prints one line. Its log level is restored on exit."""
    logger = logging.getLogger("datasets")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _rows(dataset, where: str) -> Iterator[dict]:
    """Rows of a streamed dataset; a parse or decode error becomes a ValueError that names ``where``."""
    rows = iter(dataset)
    while True:
        try:
            with _raised_not_logged():
                row = next(rows)
        except StopIteration:
            return
        except Exception as exc:  # ArrowInvalid, UnicodeDecodeError, DatasetGenerationError, ...
            raise ValueError(f"{where}: cannot be read: {type(exc).__name__}: {exc}") from exc
        yield row


def _texts_of(rows: Iterable[dict], text_column: str, where: str) -> Iterator[str]:
    """The ``text_column`` string of every row, with errors naming ``where`` and the column.

    Blank and null values are dropped (parquet and Hub text columns are often nullable, and a JSON record
    without the field reads as null next to records that have it); a column no row has is an error.
    """
    for n, row in enumerate(rows, 1):
        if text_column not in row:
            raise ValueError(f"{where}: no column {text_column!r}; columns: {list(row)} "
                             "(choose one with --text-field)")
        text = row[text_column]
        if text is not None and not isinstance(text, str):  # str([...]) would calibrate on the repr
            raise ValueError(f"{where}: record {n}: column {text_column!r} is {type(text).__name__}, not a string")
        if text and text.strip():
            yield text


def _read_file(path: Path, text_column: str) -> Iterator[str]:
    builder = _BUILDERS.get(path.suffix)
    if builder is None:  # .txt, .md, or a plain file named explicitly: one document
        text = path.read_text(encoding="utf-8", errors="replace")
        if text.strip():
            yield text
        return
    if path.stat().st_size == 0:  # `datasets` cannot infer a schema from nothing; an empty file has no text
        return
    datasets = _import_datasets(f"reading {path}")
    try:
        with _raised_not_logged():
            dataset = datasets.load_dataset(builder, data_files=str(path), split="train", streaming=True)
    except Exception as exc:
        raise ValueError(f"{path}: cannot be read as {builder}: {type(exc).__name__}: {exc}") from exc
    yield from _texts_of(_rows(dataset, str(path)), text_column, str(path))


def looks_like_path(data: str) -> bool:
    """A name that can only mean a local file (not a `datasets` name such as ``owner/name``)."""
    return (Path(data).suffix in _SUFFIXES or data.startswith(("/", "./", "../", "~", ".\\", "..\\"))
            or Path(data).is_absolute())


def _local_files(path: Path) -> list[Path]:
    # A folder contributes its known file types and suffix-less files (read as text, like LICENSE or
    # /usr/share/common-licenses/*); a file named explicitly is read as text unless its suffix says JSON or parquet.
    if not path.is_dir():
        return [path]
    files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")
                   and (p.suffix in _SUFFIXES or not p.suffix))
    if not files:
        raise ValueError(f"{path}: no {list(_SUFFIXES)} files in this folder")
    return files


def _hub_texts(data: str, split: str, text_column: str) -> Iterator[str]:
    datasets = _import_datasets(f"{data!r} is not a local path, and loading it as a dataset")
    try:
        dataset = datasets.load_dataset(data, split=split, streaming=True)
    except Exception as exc:  # not found, no network, bad split: one error type for the CLI to report
        raise ValueError(f"{data!r} is not a local path, and `datasets` could not load it: "
                         f"{type(exc).__name__}: {exc}") from exc
    yield from _texts_of(_rows(dataset, f"dataset {data!r}"), text_column, f"dataset {data!r}")


def iter_texts(data: str, *, split: str = "train", text_column: str = "text") -> Iterator[str]:
    """Non-blank texts from a local file/folder, or from a `datasets` name when ``data`` is not a path, read lazily.

    Args:
        data: a ``.txt``/``.md``/suffix-less text file (one text), a ``.jsonl``/``.json``/``.parquet`` file (one
            text per row), a folder of those (sorted by path), or a `datasets` name (streamed).
        split: the split of a `datasets` name (local files have one).
        text_column: the field of JSON records, parquet rows and dataset rows that holds the text.

    Raises:
        ValueError (when iterated): no such path, unreadable file, missing column (listing the columns there are),
            a non-string value, or `datasets` not installed where it is needed.
    """
    path = Path(data).expanduser()
    if path.exists():
        for file in _local_files(path):
            yield from _read_file(file, text_column)
    elif looks_like_path(data):
        raise ValueError(f"no such file or folder: {data!r}")
    else:
        yield from _hub_texts(data, split, text_column)


def stream_texts(data: str, *, split: str = "train", text_column: str = "text") -> Iterator[str]:
    """:func:`iter_texts`, with the first text read now: a missing file, a missing column or a source without text
    fails here (before the caller loads a model); the rest is read as it is consumed.

    Raises:
        ValueError: as :func:`iter_texts`, or ``no text found`` when the source has no non-blank text.
    """
    texts = iter_texts(data, split=split, text_column=text_column)
    first = next(texts, None)
    if first is None:
        raise ValueError(f"no text found in {data!r}")
    return itertools.chain([first], texts)


def load_texts(data: str, *, split: str = "train", text_column: str = "text") -> list[str]:
    """Every text of ``data`` as a list (see :func:`iter_texts`; :func:`stream_texts` reads only what is used).

    Raises:
        ValueError: as :func:`stream_texts`.
    """
    return list(stream_texts(data, split=split, text_column=text_column))


DEFAULT_SEQ_LEN = 8192
"""Sample length when none is given: long enough to see the ranges of long contexts (cut to the text and to the
model's positions, :func:`plan_samples`)."""
DEFAULT_NUM_SAMPLES = 4
"""Samples when no count is given (fewer when the text holds fewer distinct samples, :func:`plan_samples`)."""
MIN_TEXT_TOKENS = 512
"""Fewer text tokens than this is refused when no ``--seq-len`` is given: not even the first position bucket
beyond the sinks (``<512``) would be seen."""


def read_tokens(texts: Iterable[str], tokenizer, budget: int) -> list[int]:
    """Token ids of ``texts`` joined with EOS (when the tokenizer has one), read until ``budget`` tokens: a
    streamed source is read no further."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    stream: list[int] = []
    for text in texts:
        stream.extend(tokenizer(text, add_special_tokens=False)["input_ids"] + eos)
        if len(stream) >= budget:
            break
    return stream


@dataclass(frozen=True)
class SamplePlan:
    """How many samples of what length a calibration cuts from its text, and how often that re-reads the text.

    ``text_tokens`` is the text read (up to the samples' total: a longer text is not read further);
    ``distinct_tokens`` the text tokens the samples hold, each counted once; ``reads`` = sample tokens /
    distinct tokens (1.0: no token used twice). ``notes``: plain-language warnings for the user.
    """

    seq_len: int
    num_samples: int
    text_tokens: int
    notes: tuple[str, ...] = ()

    @property
    def sample_tokens(self) -> int:
        return self.seq_len * self.num_samples

    @property
    def distinct_tokens(self) -> int:
        return min(self.text_tokens, self.sample_tokens)

    @property
    def reads(self) -> float:
        return self.sample_tokens / self.distinct_tokens


def plan_samples(text_tokens: int, seq_len: int | None = None, num_samples: int | None = None,
                 max_positions: int | None = None) -> SamplePlan:
    """Sample length and count for ``text_tokens`` of text: what was asked for, or defaults fitted to the text.

    A ``None`` ``seq_len`` is :data:`DEFAULT_SEQ_LEN`, cut to the model's ``max_positions`` and to the text; a
    ``None`` ``num_samples`` is :data:`DEFAULT_NUM_SAMPLES`, cut to the distinct samples the text holds (at least
    one). Values given are kept; a plan that reads the text more than once gets a note saying how often.

    Raises:
        ValueError: a text shorter than a given ``seq_len``, or shorter than :data:`MIN_TEXT_TOKENS` when
            ``seq_len`` is left to the default.
    """
    notes = []
    if seq_len is None:
        if text_tokens < MIN_TEXT_TOKENS:
            raise ValueError(f"the calibration text has {text_tokens} tokens, far too few to calibrate on (at least "
                             f"{MIN_TEXT_TOKENS}; thousands for long-context ranges): give more text, or a --seq-len "
                             "that it holds")
        seq_len = min(DEFAULT_SEQ_LEN, max_positions or DEFAULT_SEQ_LEN)
        if text_tokens < seq_len:
            notes.append(f"the text has {text_tokens:,} tokens, fewer than the default --seq-len {seq_len}: one "
                         f"sample of {text_tokens:,} tokens; positions beyond it are not calibrated (give more text)")
            seq_len = text_tokens
    elif text_tokens < seq_len:
        raise ValueError(f"the calibration text has {text_tokens} tokens, fewer than one sample of --seq-len "
                         f"{seq_len}; give more text or a shorter --seq-len")
    if num_samples is None:
        num_samples = max(1, min(DEFAULT_NUM_SAMPLES, text_tokens // seq_len))
        if num_samples < DEFAULT_NUM_SAMPLES:
            would = SamplePlan(seq_len, DEFAULT_NUM_SAMPLES, text_tokens).reads
            notes.append(f"the text has {text_tokens:,} tokens: {num_samples} x {seq_len} instead of the default "
                         f"{DEFAULT_NUM_SAMPLES} x {seq_len} samples, which would read it {would:.1f} times (give "
                         "more text for more samples)")
    plan = SamplePlan(seq_len, num_samples, text_tokens)
    if plan.reads > 1:
        notes.append(f"{num_samples} x {seq_len} sample tokens from {plan.distinct_tokens:,} distinct text tokens: "
                     f"the text is read {plan.reads:.1f} times (the same text at other positions adds little; give "
                     "more text or fewer --num-samples)")
    return SamplePlan(seq_len, num_samples, text_tokens, tuple(notes))


def cut_samples(stream: list[int], seq_len: int, num_samples: int) -> list[torch.Tensor]:
    """``num_samples`` ``[1, seq_len]`` tensors, each continuing where the previous ended and wrapping around to
    the start of ``stream`` when it runs out.

    Raises:
        ValueError: bad sizes, or ``stream`` shorter than one sample.
    """
    import torch

    if seq_len < 1 or num_samples < 1:
        raise ValueError(f"seq_len and num_samples must be >= 1, got {seq_len} and {num_samples}")
    if len(stream) < seq_len:
        raise ValueError(f"the calibration text has {len(stream)} tokens, fewer than one sample of "
                         f"--seq-len {seq_len}; give more text or a shorter --seq-len")
    samples = []
    for i in range(num_samples):
        offset = (i * seq_len) % len(stream)
        ids = (stream[offset:] + stream)[:seq_len] if offset + seq_len > len(stream) else stream[offset:offset + seq_len]
        samples.append(torch.tensor([ids], dtype=torch.long))
    return samples


def pack_samples(texts: Iterable[str], tokenizer, seq_len: int, num_samples: int) -> list[torch.Tensor]:
    """Tokenize, join documents with EOS, and cut ``num_samples`` samples of exactly ``seq_len`` tokens
    (:func:`read_tokens`, then :func:`cut_samples`).

    Each sample continues where the previous one ended; when the text runs out it wraps around to the start
    (so samples repeat text once ``num_samples * seq_len`` exceeds it: :func:`plan_samples` says how often, and
    the CLI warns). ``texts`` is consumed only until there are ``num_samples * seq_len`` tokens.

    Returns:
        ``num_samples`` tensors of shape ``[1, seq_len]``.

    Raises:
        ValueError: bad sizes, or fewer than ``seq_len`` tokens of text in total.
    """
    if seq_len < 1 or num_samples < 1:
        raise ValueError(f"seq_len and num_samples must be >= 1, got {seq_len} and {num_samples}")
    return cut_samples(read_tokens(texts, tokenizer, seq_len * num_samples), seq_len, num_samples)

"""Calibration text: local ``.txt``/``.jsonl``/``.parquet`` files (or folders of them) or a `datasets` name,
tokenized and packed into fixed-length samples."""

from __future__ import annotations

import json
from pathlib import Path

import torch

__all__ = ["load_texts", "pack_samples"]

_SUFFIXES = (".txt", ".md", ".jsonl", ".json", ".parquet")


def _text_of(record, text_column: str, where: str) -> str:
    if isinstance(record, str):  # a JSON array of strings
        return record
    if not isinstance(record, dict) or text_column not in record:
        raise ValueError(f"{where}: no {text_column!r} field (use --text-column)")
    text = record[text_column]
    if not isinstance(text, str):  # str(None) would calibrate on the word "None"
        raise ValueError(f"{where}: field {text_column!r} is {type(text).__name__}, not a string")
    return text


def _read_file(path: Path, text_column: str) -> list[str]:
    if path.suffix not in (".jsonl", ".json", ".parquet"):  # .txt, .md, or a plain file named explicitly
        return [path.read_text(encoding="utf-8", errors="replace")]
    if path.suffix in (".jsonl", ".json"):
        try:
            content = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
        if path.suffix == ".json":  # one JSON document (an array of records or strings, or one record) ...
            try:
                doc = json.loads(content)
            except json.JSONDecodeError:
                doc = None  # ... or JSON lines under a .json name
            if isinstance(doc, list):
                return [_text_of(r, text_column, f"{path}: item {n}") for n, r in enumerate(doc)]
            if isinstance(doc, dict):
                return [_text_of(doc, text_column, str(path))]
        texts = []
        for n, line in enumerate(content.splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{n}: not a JSON line ({exc.msg})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{n}: expected a JSON object with a {text_column!r} field")
            texts.append(_text_of(record, text_column, f"{path}:{n}"))
        return texts
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"reading {path} needs pyarrow: pip install pyarrow") from None
    table = pq.read_table(path)
    if text_column not in table.column_names:
        raise ValueError(f"{path}: no column {text_column!r}; columns: {table.column_names}")
    return [str(t) for t in table.column(text_column).to_pylist() if t is not None]


def _looks_like_path(data: str) -> bool:
    """A name that can only mean a local file (not a `datasets` name such as ``owner/name``)."""
    return (Path(data).suffix in _SUFFIXES or data.startswith(("/", "./", "../", "~", ".\\", "..\\"))
            or Path(data).is_absolute())


def load_texts(data: str, *, split: str = "train", text_column: str = "text") -> list[str]:
    """Texts from a local file/folder, or from the Hugging Face `datasets` library when ``data`` is not a path.

    Raises:
        ValueError: unsupported file type, missing column, or an empty result.
    """
    path = Path(data).expanduser()
    if path.exists():
        # A folder contributes its known file types and suffix-less files (read as text, like LICENSE or
        # /usr/share/common-licenses/*); a file named explicitly is read as text unless its suffix says JSON
        # lines or parquet.
        files = [path]
        if path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")
                           and (p.suffix in _SUFFIXES or not p.suffix))
        if not files:
            raise ValueError(f"{path}: no {list(_SUFFIXES)} files in this folder")
        texts = [t for f in files for t in _read_file(f, text_column)]
    elif _looks_like_path(data):
        raise ValueError(f"no such file or folder: {data!r}")
    else:
        try:
            import datasets
        except ImportError:
            raise ValueError(f"{data!r} is not a local path, and loading it as a dataset needs the `datasets` "
                             "package: pip install datasets") from None
        try:
            ds = datasets.load_dataset(data, split=split)
        except Exception as exc:  # not found, no network, bad split: one error type for the CLI to report
            raise ValueError(f"{data!r} is not a local path, and `datasets` could not load it: "
                             f"{type(exc).__name__}: {exc}") from exc
        if text_column not in ds.column_names:
            raise ValueError(f"dataset {data!r} has no column {text_column!r}; columns: {ds.column_names}")
        texts = [str(t) for t in ds[text_column]]
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise ValueError(f"no text found in {data!r}")
    return texts


def pack_samples(texts: list[str], tokenizer, seq_len: int, num_samples: int) -> list[torch.Tensor]:
    """Tokenize, join documents with EOS, and cut ``num_samples`` samples of exactly ``seq_len`` tokens.

    Each sample continues where the previous one ended; when the text runs out it wraps around to the start
    (so samples repeat text once ``num_samples * seq_len`` exceeds it), because a long-context calibration
    needs long samples more than it needs many distinct ones. The CLI summary reports the token count.

    Returns:
        ``num_samples`` tensors of shape ``[1, seq_len]``.

    Raises:
        ValueError: bad sizes, or fewer than ``seq_len`` tokens of text in total.
    """
    if seq_len < 1 or num_samples < 1:
        raise ValueError(f"seq_len and num_samples must be >= 1, got {seq_len} and {num_samples}")
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    stream: list[int] = []
    for text in texts:
        stream.extend(tokenizer(text, add_special_tokens=False)["input_ids"] + eos)
        if len(stream) >= seq_len * num_samples:
            break
    if len(stream) < seq_len:
        raise ValueError(f"the calibration text has {len(stream)} tokens, fewer than one sample of "
                         f"--seq-len {seq_len}; give more text or a shorter --seq-len")
    samples = []
    for i in range(num_samples):
        offset = (i * seq_len) % len(stream)
        ids = (stream[offset:] + stream)[:seq_len] if offset + seq_len > len(stream) else stream[offset:offset + seq_len]
        samples.append(torch.tensor([ids], dtype=torch.long))
    return samples

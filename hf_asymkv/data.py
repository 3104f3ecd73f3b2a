"""Calibration text: local ``.txt``/``.jsonl``/``.parquet`` files (or folders of them) or a `datasets` name,
tokenized and packed into fixed-length samples."""

from __future__ import annotations

import json
from pathlib import Path

import torch

__all__ = ["load_texts", "pack_samples"]

_SUFFIXES = (".txt", ".md", ".jsonl", ".json", ".parquet")


def _read_file(path: Path, text_column: str) -> list[str]:
    if path.suffix not in (".jsonl", ".json", ".parquet"):  # .txt, .md, or a plain file named explicitly
        return [path.read_text(encoding="utf-8", errors="replace")]
    if path.suffix in (".jsonl", ".json"):
        texts = []
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{n}: not a JSON line ({exc.msg})") from None
            if not isinstance(record, dict) or text_column not in record:
                raise ValueError(f"{path}:{n}: no {text_column!r} field (use --text-column)")
            texts.append(str(record[text_column]))
        return texts
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"reading {path} needs pyarrow: pip install pyarrow") from None
    table = pq.read_table(path)
    if text_column not in table.column_names:
        raise ValueError(f"{path}: no column {text_column!r}; columns: {table.column_names}")
    return [str(t) for t in table.column(text_column).to_pylist()]


def load_texts(data: str, *, split: str = "train", text_column: str = "text") -> list[str]:
    """Texts from a local file/folder, or from the Hugging Face `datasets` library when ``data`` is not a path.

    Raises:
        ValueError: unsupported file type, missing column, or an empty result.
    """
    path = Path(data)
    if path.exists():
        # A folder contributes its known file types; a file named explicitly is read as text unless its
        # suffix says JSON lines or parquet.
        files = sorted(p for p in path.rglob("*") if p.suffix in _SUFFIXES) if path.is_dir() else [path]
        if not files:
            raise ValueError(f"{path}: no {list(_SUFFIXES)} files in this folder")
        texts = [t for f in files for t in _read_file(f, text_column)]
    else:
        try:
            import datasets
        except ImportError:
            raise ValueError(f"{data!r} is not a local path, and loading it as a dataset needs the `datasets` "
                             "package: pip install datasets") from None
        ds = datasets.load_dataset(data, split=split)
        if text_column not in ds.column_names:
            raise ValueError(f"dataset {data!r} has no column {text_column!r}; columns: {ds.column_names}")
        texts = [str(t) for t in ds[text_column]]
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise ValueError(f"no text found in {data!r}")
    return texts


def pack_samples(texts: list[str], tokenizer, seq_len: int, num_samples: int) -> list[torch.Tensor]:
    """Tokenize, join documents with EOS, and cut ``num_samples`` samples of exactly ``seq_len`` tokens.

    Text is reused from the start when it runs out (each sample starts at a different offset), because a
    long-context calibration needs long samples more than it needs many distinct ones.

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

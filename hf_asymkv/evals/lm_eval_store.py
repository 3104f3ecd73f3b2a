"""Answers per (request, scheme), kept in a JSON-lines file as they come, so that a long run can be resumed.

The first line holds the run's settings (model, lengths, chat template, ...); every later line one request: its
key (a hash of what the model was asked), task, document id and each scheme's answer. Reopening the file with other
settings is refused (answers made under other settings would be mixed in); with the same settings, requests and
schemes already answered are not run again, and schemes added to a run are answered for the requests it holds.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

__all__ = ["ResponseStore", "request_key"]


def request_key(*parts) -> str:
    """A stable key of what the model is asked (request type, text or token ids, generation limits)."""
    return hashlib.sha256(json.dumps(parts, ensure_ascii=False, default=str).encode("utf-8")).hexdigest()[:32]


class ResponseStore:
    """``{key: {scheme: answer}}``, appended to ``path`` (JSON lines) as answers arrive; in memory only without one.

    Args:
        path: the file; read first when it exists.
        settings: what the answers depend on besides the request (JSON-serializable).

    Raises:
        ValueError: ``path`` holds answers made with other settings (the message names the differences), or is not
            a response file.
    """

    def __init__(self, path: str | Path | None, settings: dict):
        self.path = Path(path) if path is not None else None
        self.settings = json.loads(json.dumps(settings, default=str))
        self.answers: dict[str, dict[str, dict]] = {}
        if self.path is not None and self.path.is_file() and self.path.stat().st_size:
            self._load()
        elif self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._append({"settings": self.settings})

    def _load(self) -> None:
        lines = self.path.read_text(encoding="utf-8").splitlines()
        try:
            header = json.loads(lines[0])["settings"]
            rows = [json.loads(line) for line in lines[1:] if line.strip()]
        except (json.JSONDecodeError, KeyError, TypeError, IndexError):
            raise ValueError(f"{str(self.path)!r} is not a response file of `hf-asymkv eval lm-eval`") from None
        if header != self.settings:
            diff = {k: (header.get(k), self.settings.get(k)) for k in sorted({*header, *self.settings})
                    if header.get(k) != self.settings.get(k)}
            raise ValueError(f"{str(self.path)!r} holds answers made with other settings ({diff}, as (file, now)); "
                             "give another --out folder, or remove the file to start again")
        for row in rows:
            self.answers.setdefault(row["key"], {}).update(row["answers"])

    def _append(self, row: dict) -> None:
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")

    def missing(self, key: str, schemes: list[str]) -> list[str]:
        """The schemes of ``schemes`` without an answer to request ``key``, in the given order."""
        have = self.answers.get(key, {})
        return [s for s in schemes if s not in have]

    def add(self, key: str, request, answers: dict[str, dict], cost: dict | None = None) -> None:
        """Keep ``answers`` (``{scheme: answer}``) to request ``key``; ``request``: lm-eval's ``Instance`` (its task
        and document id are written beside the answers) or None; ``cost``: what answering took (prompt tokens,
        seconds), written beside them and never read back as an answer."""
        self.answers.setdefault(key, {}).update(answers)
        if self.path is not None:
            where = {"task": request.task_name, "doc_id": request.doc_id} if request is not None else {}
            self._append({"key": key, **where, "answers": answers, **({"cost": cost} if cost else {})})

    def get(self, key: str, scheme: str) -> dict:
        return self.answers[key][scheme]

    def __len__(self) -> int:
        return len(self.answers)

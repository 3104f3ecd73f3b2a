"""Helpers every model evaluation shares: scheme checks, length limits, progress bars and heartbeats, run
metadata."""

from __future__ import annotations

import platform
import sys
import time
from collections.abc import Iterable, Iterator

import torch

from ..bench.schemes import make_cache, scheme_attention, scheme_names

__all__ = ["HEARTBEAT_SECONDS", "Heartbeat", "check_length", "check_schemes", "max_positions", "progress", "run_meta",
           "schemes_for"]

HEARTBEAT_SECONDS = 60.0
"""Seconds between two heartbeat lines of a long run (:class:`Heartbeat`)."""


def check_schemes(schemes: list[str]) -> list[str]:
    """The scheme list with ``dynamic`` first (every comparison needs the full-precision reference).

    Raises:
        ValueError: an unknown or repeated name (the message lists the known ones).
    """
    known = scheme_names()
    bad = [s for s in schemes if s not in known]
    if bad:
        raise ValueError(f"unknown cache scheme(s) {bad}; known schemes: {known}")
    if len(set(schemes)) != len(schemes):
        raise ValueError(f"cache schemes repeated in {schemes}")
    return ["dynamic", *[s for s in schemes if s != "dynamic"]]


def schemes_for(model, schemes: list[str]) -> tuple[list[str], dict[str, str]]:
    """Split ``schemes`` into those that can build a cache for ``model`` and those that cannot (with why).

    transformers' ``QuantizedCache`` refuses models with sliding-window layers (Gemma-3): those schemes are
    reported as skipped rather than failing the whole run. Schemes that need their own attention
    implementation are tried under it (:func:`hf_asymkv.bench.schemes.scheme_attention`).
    """
    usable, skipped = [], {}
    for name in schemes:
        try:
            with scheme_attention(model, name):
                make_cache(name, model.config)
        except ValueError as exc:
            skipped[name] = str(exc).splitlines()[0]
        else:
            usable.append(name)
    return usable, skipped


def max_positions(model) -> int | None:
    """The ``max_position_embeddings`` (text decoder) of a model or of its config, or None when it declares none."""
    config = getattr(model, "config", model)
    return getattr(config.get_text_config(decoder=True), "max_position_embeddings", None)


def check_length(model, length: int, what: str = "--lengths") -> None:
    """Raise ``ValueError`` when ``length`` tokens exceed the position limit of ``model`` (a model or a config)."""
    limit = max_positions(model)
    if limit and length > limit:
        raise ValueError(f"{what}: {length} tokens exceed the model's max_position_embeddings ({limit})")


def progress(items: Iterable, total: int | None = None, desc: str = "", enabled: bool = True) -> Iterator:
    """``tqdm`` over ``items`` when tqdm is installed and ``enabled`` (on stderr); the plain iterable otherwise."""
    if enabled:
        try:
            from tqdm.auto import tqdm
        except ImportError:
            pass
        else:
            return iter(tqdm(items, total=total, desc=desc, leave=False, dynamic_ncols=True))
    return iter(items)


class Heartbeat:
    """Called at every step of a long run (``tick("needle prompt 2/6, asymkv-lean (7/25)")``); prints one line
    on stderr at most every ``every`` seconds, so that a run, ``--quiet`` or not, shows that it is alive and how
    far it got, at a rate that stays readable in a log.

    Args:
        label: what runs, at the start of each line (``"eval frontier"``).
        every: seconds between lines (the first comes ``every`` seconds after the start); 0 prints every step;
            default :data:`HEARTBEAT_SECONDS`.
    """

    def __init__(self, label: str, every: float | None = None):
        self.label, self.every = label, HEARTBEAT_SECONDS if every is None else every
        self.start = self.last = time.monotonic()

    def __call__(self, where: str) -> None:
        now = time.monotonic()
        if now - self.last < self.every:
            return
        self.last = now
        minutes, seconds = divmod(int(now - self.start), 60)
        line = f"{self.label}: {where} ({minutes}m{seconds:02d}s)"
        try:  # between tqdm's bars when they are on screen
            from tqdm.auto import tqdm
        except ImportError:
            print(line, file=sys.stderr, flush=True)
        else:
            tqdm.write(line, file=sys.stderr)


def run_meta(model, model_name: str, command: str | None, **settings) -> dict:
    """What a result file needs to be rerun and trusted: command, model, dtype, threads, library versions."""
    import transformers

    from ..version import __version__

    return {"command": command, "model": model_name, "model_class": type(model).__name__,
            "dtype": str(model.dtype).removeprefix("torch."), "threads": torch.get_num_threads(),
            "versions": {"hf_asymkv": __version__, "torch": torch.__version__,
                         "transformers": transformers.__version__, "python": sys.version.split()[0]},
            "machine": platform.machine(), "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
            **settings}

"""The flags that say how prompts reach each cache (``--forms``, ``--prefill-chunk``) and how the shared
full-precision prefill runs (``--shared-prefill-chunk``): `eval lm-eval` and `eval needle` take the same ones.

Nothing heavy is imported here: ``--help`` stays fast.
"""

from __future__ import annotations

import argparse

from ..evals.forms import FORMS, ONE_PASS, QUESTION, TAIL_FORM, form_list
from .args import at_least, name_list

__all__ = ["SHARED_PREFILL_CHUNK", "add_form_args", "add_shared_prefill_arg", "forms_from_args"]

SHARED_PREFILL_CHUNK = 1024
"""Default of ``--shared-prefill-chunk`` (the same as :data:`hf_asymkv.evals.prefill.SHARED_PREFILL_CHUNK`, which
imports torch)."""


def add_form_args(p: argparse.ArgumentParser, default: str = ONE_PASS, tail: bool = False) -> None:
    """``--forms``, ``--prefill-chunk`` and ``--shared-prefill-chunk`` on ``p``; ``tail``: the needle grid's own
    form (its last 16 prompt tokens through the cache) is offered too."""
    known = [*([TAIL_FORM] if tail else []), *FORMS]
    p.add_argument("--forms", type=name_list(known, "form"), default=default,
                   help=f"comma-separated forms, from: {', '.join(known)}. {ONE_PASS}: the prompt in one prefill, the "
                   f"question attends the document at full precision; {QUESTION}: the document prefilled as turn 1, "
                   "the question (what follows the document: the prompt's last line on) fed through each scheme's "
                   "cache as turn 2, so it reads the stored document"
                   + (f"; {TAIL_FORM}: the prompt's last 16 tokens through the cache" if tail else "")
                   + ". The answers of each form are tabled side by side")
    p.add_argument("--prefill-chunk", type=at_least(1), default=None, metavar="N",
                   help="also answer in the chunked-prefill form: the whole prompt through each scheme's own cache "
                   "in forwards of N tokens, every chunk after the first reading the stored history")
    add_shared_prefill_arg(p)


def add_shared_prefill_arg(p: argparse.ArgumentParser) -> None:
    """``--shared-prefill-chunk`` on ``p``."""
    p.add_argument("--shared-prefill-chunk", type=at_least(1, zero_ok=True), default=SHARED_PREFILL_CHUNK,
                   metavar="N", help="tokens per forward of the full-precision prefill the schemes share (the same "
                   "result as one forward for a DynamicCache, up to float rounding; far cheaper for long prompts on "
                   "sliding-window models); 0: one forward")


def forms_from_args(args) -> list[str]:
    """The forms a command runs in, from ``args.forms`` and ``args.prefill_chunk``."""
    return form_list(args.forms, args.prefill_chunk, known=(TAIL_FORM, *FORMS))

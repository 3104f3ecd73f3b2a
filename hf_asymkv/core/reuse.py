"""Noticing a cache used again for a new prompt: a warning, once per cache, by a rule the cache can apply.

A second ``generate`` (or ``pipeline``) call on a cache that already answered a prompt hands it the new prompt
minus its first ``N`` tokens, ``N`` being what the cache holds: transformers assumes those are the same tokens.
That is right when the new prompt continues the conversation (previous prompt + answer + a new turn) and
silently wrong for an unrelated prompt, whose answer then reads the old conversation. The cache never sees token
ids, only K/V at positions that transformers computes from the cache's own length, so the two cases look the
same to it. What it does see is the shape of the calls:

**The rule.** One ``generate`` call is a prefill (one or several multi-token updates: chunked prefill) followed
by single-token decode steps. A multi-token update that arrives after decode steps, with no ``crop`` or
``reset`` in between and outside recording (assisted decoding verifies several draft tokens at a time, under
``activate_past_recording``), starts a new call on a used cache: :class:`CacheReuseWarning`, once per cache.

It warns for a deliberate multi-turn continuation too (which is legitimate); silence it there with
``warnings.filterwarnings("ignore", category=CacheReuseWarning)``. It cannot warn for a one-token new prompt.
"""

from __future__ import annotations

import warnings

__all__ = ["CacheReuseWarning", "ReuseWatch"]


class CacheReuseWarning(UserWarning):
    """A cache that already answered a prompt receives a new one (see the module docstring for the rule)."""


class ReuseWatch:
    """Applies the rule above to the updates of one layer of a cache, ``layer_idx`` (the first quantized one)."""

    def __init__(self, layer_idx: int):
        self.layer_idx = layer_idx
        self.decoding = False  # the last update was a decode step
        self.warned = False
        self.rollbacks = 0  # the layer's rollback count at the last update

    def update(self, tokens: int, held: int, recording: bool, rollbacks: int = 0) -> None:
        """Record one update of ``tokens`` tokens onto a layer holding ``held`` tokens, which has been rolled back
        ``rollbacks`` times in all (a crop since the last update, e.g. kvpress's pipeline slicing the cache back to
        its context, is one asked for: no warning); warn by the rule."""
        if rollbacks != self.rollbacks:
            self.rollbacks = rollbacks
            self.rewound()
        if tokens > 1 and self.decoding and not recording and not self.warned:
            self.warned = True
            warnings.warn(CacheReuseWarning(
                f"AsymKVCache: a new {tokens}-token input arrives on a cache that already holds {held} tokens from "
                "earlier decoding (a second generate or pipeline call on the same cache?). transformers treats the "
                f"first {held} tokens of the new prompt as already cached: right when it continues the same "
                "conversation, wrong for an unrelated prompt, whose answer would read the old one. Use a new "
                "AsymKVCache (or cache.reset()) per prompt; to continue a conversation on purpose, silence this with "
                "warnings.filterwarnings('ignore', category=hf_asymkv.core.reuse.CacheReuseWarning). Said once per "
                "cache."), stacklevel=4)
        self.decoding = tokens == 1

    def rewound(self) -> None:
        """A ``crop`` or ``reset``: whoever called it manages the cache's length on purpose."""
        self.decoding = False

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
    """Applies the rule above to the updates of one layer of a cache, ``layer_idx`` (the first quantized one; None:
    a cache without one, nothing is watched).

    It keeps ``seen``, the layer's length after the last update that was not a decode step (or after a crop or
    reset): a multi-token update that finds the layer longer than that comes after decode steps. Decode steps are
    not looked at, so the rule holds where they run inside a compiled graph that never calls :meth:`update`.
    """

    def __init__(self, layer_idx: int | None):
        self.layer_idx = layer_idx
        self.seen = 0
        self.warned = False  # once per cache, not per process: a cache serves one request (one thread) at a time
        self.rollbacks = 0  # the layer's rollback count at the last update

    def update(self, tokens: int, layer) -> None:
        """Record one update of ``tokens`` tokens onto ``layer`` (a cache layer, before the update); warn by the rule.
        Reads the layer's length on the host for updates of other than one token only. A rollback of the layer since
        the last update (its ``rollbacks`` count moved: e.g. kvpress's pipeline slicing the cache back to its
        context) is one asked for: the length it left is the new reference. An empty update (a read: no token
        arrives) is no input at all."""
        if tokens <= 1:
            return
        held = int(layer.get_seq_length())
        rollbacks = getattr(layer, "rollbacks", 0)
        if rollbacks != self.rollbacks:
            self.rollbacks = rollbacks
            self.rewound(held)
        if held > self.seen and not layer.record_past and not self.warned:
            self.warned = True
            warnings.warn(CacheReuseWarning(
                f"AsymKVCache: a new {tokens}-token input arrives on a cache that already holds {held} tokens from "
                "earlier decoding (a second generate or pipeline call on the same cache?). transformers treats the "
                f"first {held} tokens of the new prompt as already cached: right when it continues the same "
                "conversation, wrong for an unrelated prompt, whose answer would read the old one. Use a new "
                "AsymKVCache (or cache.reset()) per prompt; to continue a conversation on purpose, silence this with "
                "warnings.filterwarnings('ignore', category=hf_asymkv.core.reuse.CacheReuseWarning). Said once per "
                "cache."), stacklevel=4)
        self.seen = held + tokens

    def rewound(self, held: int = 0) -> None:
        """A ``crop`` (to ``held`` tokens) or ``reset``: whoever called it manages the cache's length on purpose."""
        self.seen = held

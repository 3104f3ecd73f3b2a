"""Whether the attention module updating the cache has forward hooks: when a multi-token update waits exact.

A multi-token update (a prefill) could be quantized at once, or held exact until the cache's next update of any
layer. Holding is what code that runs right after a layer's attention needs: a kvpress press is a forward hook on
each attention module that reads the layer's K/V in the prefill and assigns the tokens it keeps
(:mod:`~hf_asymkv.core.kv_assign`), and it must score the exact prefill. Holding is also a cost: after a plain
prefill nothing follows the last layer's attention, so its whole prompt would stay exact, in the model's dtype,
until the first decode step (1/L of the cache at full size, where a user's memory counter sees it).

The cache cannot see the module that calls it, and no hook announces itself to it, so :func:`caller_hooked` looks:
transformers' attention modules call ``past_key_values.update(...)`` from their own ``forward``, so the nearest frame
up the stack whose ``self`` is an ``nn.Module`` is that attention module, and a press has registered its hook there
(``module.register_forward_hook``). This reads the stack and the module's hook table (``_forward_hooks``,
``torch.nn.modules.module._global_forward_hooks``): PyTorch has no public query for either, and both have been the
same since PyTorch 1.x. Where no module is found (``cache.update`` called by hand), nothing is held.

Hooks that never read the cache do not count: transformers 5 installs a recording hook on every attention module the
first time a model is asked for ``output_attentions`` or ``output_hidden_states``
(``transformers.utils.output_capturing``), and leaves it there for the model's life. Counting it would hold every
later prefill exact, in every model that once returned its attentions (a CI run found it: a test asked for
attentions, and a later prefill on the same model left ``pending_*`` behind).
"""

from __future__ import annotations

import sys

import torch

__all__ = ["caller_hooked"]

SEARCH_FRAMES = 6
"""Frames looked at above the cache's ``update``: the attention module's ``forward`` is the first in transformers;
a model that routes the call through a helper or two is still found."""


def caller_hooked(skip: int = 2) -> bool:
    """Whether the nearest ``nn.Module`` up the stack (above ``skip`` frames: this function and the cache's
    ``update``) has forward hooks other than transformers' recorders, or any such global forward hook is registered.
    False when no module is found, and inside a compiled graph (frames are not traced; a compiled layer holds nothing
    anyway)."""
    if torch.compiler.is_compiling():
        return False
    frame = sys._getframe(skip)
    for _ in range(SEARCH_FRAMES):
        if frame is None:
            break
        owner = frame.f_locals.get("self")
        if isinstance(owner, torch.nn.Module):
            return _reads_cache(owner._forward_hooks) or _reads_cache(torch.nn.modules.module._global_forward_hooks)
        frame = frame.f_back
    return False


RECORDING_HOOKS = (("transformers.utils.output_capturing", "output_capturing_hook"),)
"""``(module, function name)`` of hooks known not to read the cache: transformers' output recorders."""


def _reads_cache(hooks) -> bool:
    """Whether ``hooks`` (a module's or the global forward-hook table) holds a hook other than a known recorder."""
    return any((getattr(hook, "__module__", None), getattr(hook, "__name__", None)) not in RECORDING_HOOKS
               for hook in hooks.values())

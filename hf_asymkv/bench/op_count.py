"""What a cache update costs beyond its bytes: torch operations (on a GPU, each one a kernel launch) and host
synchronizations (each one stalls the CPU until the GPU has caught up), counted with a dispatch mode. Operations
are the same on every device; a few host syncs are CPU-only (the scale rounding's ``.any()`` checks, which skip
work on a CPU and are not made on a GPU), so count on the GPU for its figure.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .schemes import make_cache

__all__ = ["OpCounter", "flush_cost_rows"]

# metadata-only operations (views, allocations): no kernel launch
VIEW_OPS = frozenset({"alias", "as_strided", "detach", "empty", "empty_like", "expand", "new_empty", "permute",
                      "scalar_tensor", "select", "slice", "split", "t", "transpose", "unbind", "unsqueeze", "view",
                      "_unsafe_view"})
SYNC_OPS = frozenset({"_local_scalar_dense", "is_nonzero", "item"})


class OpCounter(TorchDispatchMode):
    """``with OpCounter() as c: ...``: ``c.ops`` counts every aten operation by name; ``c.launches`` and
    ``c.syncs`` split them into kernel-launching operations and host synchronizations."""

    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    @property
    def syncs(self) -> int:
        return sum(n for name, n in self.ops.items() if name in SYNC_OPS)

    @property
    def launches(self) -> int:
        return sum(n for name, n in self.ops.items() if name not in SYNC_OPS | VIEW_OPS)


@torch.no_grad()
def flush_cost_rows(model, presets: list[str], batch: int = 1) -> list[dict]:
    """Per preset, operations and host syncs of one layer's ``update`` for one new token, on a step that quantizes
    a block (a flush) and on one that does not: ``[{preset, step, launches, syncs}]``."""
    cfg, device = model.config, model.device
    shape = (batch, cfg.num_key_value_heads, 1, cfg.head_dim)
    rows = []
    for preset in presets:
        cache = make_cache(f"asymkv-{preset}", cfg)
        seen: dict[bool, OpCounter] = {}
        for step in range(10**6):
            k, v = (torch.randn(shape, device=device, dtype=model.dtype) for _ in range(2))
            before = cache.stats()["tokens_quantized"]
            with OpCounter() as counter:
                cache.update(k, v, 0)
            if step >= 2:  # past the first steps (lazy initialization, first allocations)
                seen.setdefault(cache.stats()["tokens_quantized"] > before, counter)
            if len(seen) == 2:
                break
        rows += [{"preset": preset, "step": "flush" if flushed else "no flush", "launches": c.launches,
                  "syncs": c.syncs} for flushed, c in sorted(seen.items())]
    return rows

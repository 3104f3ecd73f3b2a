"""Launches per decode step, read from ``torch.profiler``: what bounds a step by host time rather than by bytes.

On a GPU, a step's *host launches* are its calls of the CUDA launch API (``cudaLaunchKernel``, ``cuLaunchKernel``
and their ``Ex`` forms, one ``cudaGraphLaunch`` for a replayed CUDA graph) and its *kernels* the device kernels the
profiler saw run (those a graph replays included); *attention kernels* are the Triton decode kernel's
(``partial_attention_kernel``): whether a step ran it. On CPU there is no launch: host launches are the step's
top-level ``aten::`` operators (each one a launch on a GPU when run eagerly), kernels are None.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["LAUNCH_APIS", "count_launches"]

LAUNCH_APIS = frozenset({"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
                         "cudaGraphLaunch", "cudaLaunchCooperativeKernel"})
ATTENTION_KERNEL = "partial_attention_kernel"


def _top_level_aten(events) -> int:
    """``aten::`` events with no ``aten::`` event above them (an operator's own sub-operators are not launches)."""
    count = 0
    for event in events:
        if not event.name.startswith("aten::"):
            continue
        parent = event.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        count += parent is None
    return count


def count_launches(step: Callable[[], object], device: torch.device, steps: int = 2) -> dict[str, float | None]:
    """Run ``step`` (one decode step) ``steps`` times under the profiler: ``{launches_per_step, kernels_per_step,
    attention_kernels_per_step}`` (the last two None on CPU)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize(device)
    events = prof.events()
    if not cuda:
        return {"launches_per_step": _top_level_aten(events) / steps, "kernels_per_step": None,
                "attention_kernels_per_step": None}
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    return {"launches_per_step": sum(e.name in LAUNCH_APIS for e in events) / steps,
            "kernels_per_step": len(kernels) / steps,
            "attention_kernels_per_step": sum(ATTENTION_KERNEL in e.name for e in kernels) / steps}

"""hf_asymkv/bench/launch_count.py on CPU: a step's top-level aten operators (an operator's own sub-operators not
counted), per step."""

from __future__ import annotations

import torch

from hf_asymkv.bench.launch_count import count_launches


def test_top_level_operators_per_step():
    a, b = torch.ones(4), torch.ones(4)

    def step():
        c = a + b  # one operator
        c.mul_(2)  # one
        torch.outer(c, c)  # one, whatever it calls inside

    counts = count_launches(step, torch.device("cpu"), steps=3)
    assert counts == {"launches_per_step": 3.0, "kernels_per_step": None, "attention_kernels_per_step": None}

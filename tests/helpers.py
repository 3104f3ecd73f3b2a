"""Plain helpers shared by several test modules (fixtures live in conftest.py)."""

import warnings

import torch


def greedy_with_logits(model, prompt: torch.Tensor, cache, n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy ``generate`` with ``cache``: ``(sequences [B, T + n], logits [n, B, vocab])``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model.generate(prompt, cache=cache, max_new_tokens=n, do_sample=False, return_dict_in_generate=True,
                             output_logits=True)
    return out.sequences, torch.stack(out.logits)

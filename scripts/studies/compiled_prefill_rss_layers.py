"""Peak RSS growth of one compiled whole-forward prefill at 4096 tokens, with the default model cut to its first N
layers (issue 38): how the growth scales per layer separates a buffer kept alive across layers from a one-layer peak.
Measured as `hf-asymkv bench` measures it (``PeakRSS``); a first, untimed call compiles.

    python scripts/studies/compiled_prefill_rss_layers.py LAYERS SCHEME [LENGTH]

e.g. ``2 asymkv-balanced-static-fused-compiled`` and ``2 hf-static-compiled``. Prints two measured runs:
``scheme layers growth MiB``.
"""

import sys
import warnings

import torch

from hf_asymkv.bench.schemes import make_cache, scheme_attention, scheme_forward
from hf_asymkv.bench.speed import PeakRSS
from hf_asymkv.core.compat import cache_kwargs
from hf_asymkv.models import load_model

warnings.simplefilter("ignore")
torch.set_num_threads(1)
torch.set_grad_enabled(False)


def main() -> None:
    layers, name = int(sys.argv[1]), sys.argv[2]
    length = int(sys.argv[3]) if len(sys.argv) > 3 else 4096
    model, _ = load_model()
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:layers]
    ids = torch.randint(0, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(0))

    def prefill() -> int:
        with scheme_attention(model, name), PeakRSS() as rss:
            cache = make_cache(name, model.config, max_cache_len=length + 2)
            scheme_forward(model, name)(input_ids=ids, **cache_kwargs(cache), use_cache=True, logits_to_keep=1)
        return rss.growth

    prefill()  # compiles
    for _ in range(2):
        print(name, layers, "growth MiB", round(prefill() / 2**20), flush=True)


if __name__ == "__main__":
    main()

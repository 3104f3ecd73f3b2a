"""Where the peak RSS of one whole-model decode run goes, per scheme: growth after building the cache, after the
prefill, after the first and the last decode step (each: RSS now, and the peak sampled since the start), the way
`hf-asymkv bench` measures its peak RSS growth column (``PeakRSS``: glibc trimmed first, /proc/self/statm sampled
every 5 ms). Every scheme is run once untimed first (compiled schemes compile there), then twice measured.

    python scripts/studies/compiled_rss.py 4096 dynamic,hf-static-compiled,asymkv-balanced-static-fused-compiled

Prints one line per scheme and run: ``name growth MiB G [(stage, MiB now, MiB peak), ...]``.
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
STEPS = 16


def run(model, ids, name: str, steps: int, report: bool) -> None:
    marks = []
    with scheme_attention(model, name), PeakRSS() as rss:
        cache = make_cache(name, model.config, max_cache_len=ids.shape[1] + 1 + STEPS)
        forward = scheme_forward(model, name)
        marks.append(("cache", rss.rss() - rss.start, rss.peak - rss.start))
        out = forward(input_ids=ids, **cache_kwargs(cache), use_cache=True, logits_to_keep=1)
        marks.append(("prefill", rss.rss() - rss.start, rss.peak - rss.start))
        token = out.logits[:, -1:].argmax(-1)
        for i in range(steps + 1):
            out = forward(input_ids=token, **cache_kwargs(cache), use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
            if i in (0, steps):
                marks.append((f"step{i}", rss.rss() - rss.start, rss.peak - rss.start))
    if report:
        print(name, "growth MiB", round(rss.growth / 2**20),
              [(m, round(now / 2**20), round(peak / 2**20)) for m, now, peak in marks], flush=True)


def main() -> None:
    length, schemes = int(sys.argv[1]), sys.argv[2].split(",")
    model, _ = load_model()
    ids = torch.randint(0, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(0))
    for name in schemes:  # untimed first run: compiles
        run(model, ids, name, 1, report=False)
    for _ in range(2):
        for name in schemes:
            run(model, ids, name, STEPS, report=True)


if __name__ == "__main__":
    main()

"""Where one RULER request's CPU time goes with every scheme (issue 40): the shared 4000-token prefill, then per
scheme the cache filled from it and 8 decode steps, as ``hf_asymkv.evals.scheme_decode.generate_per_scheme`` runs
them (random prompt tokens; an 8-token answer is what a right needle answer costs).

    python scripts/studies/ruler_request_cost.py [THREADS] [--dtype float32|bfloat16] [--model PATH]

Prints one line per scheme: ``name: fill Ns, 8 steps Ns``; the first scheme's fill is the shared prefill itself.
"""

import argparse
import time
import warnings

import torch

from hf_asymkv.cli.lm_eval_cmd import DEFAULT_SCHEMES
from hf_asymkv.evals import scheme_decode
from hf_asymkv.models import load_model

warnings.simplefilter("ignore")
torch.set_grad_enabled(False)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("threads", type=int, nargs="?", default=1)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--model", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    model, _ = load_model(args.model, dtype=dtype) if args.model else load_model(dtype=dtype)
    ids = torch.randint(100, 20000, (1, 4000), generator=torch.Generator().manual_seed(0))
    start = time.perf_counter()
    for name, cache, logits in scheme_decode.prefilled_caches(model, ids, DEFAULT_SCHEMES.split(",")):
        fill = time.perf_counter() - start
        steps = time.perf_counter()
        for _ in range(8):
            logits = scheme_decode._prefill(model, logits[0].argmax().view(1, 1), cache)
        print(f"{name}: fill {fill:.2f}s, 8 steps {time.perf_counter() - steps:.2f}s", flush=True)
        start = time.perf_counter()


if __name__ == "__main__":
    main()

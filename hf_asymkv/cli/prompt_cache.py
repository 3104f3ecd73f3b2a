"""`hf-asymkv prompt-cache`: prefill a document once, save the cache to a file, answer questions from it.

Prints the file's bytes against ``memory_footprint()`` and a bf16 ``DynamicCache``, the prefill time, and per
question the load + first-answer-token time with how many times sooner that is than the prefill
(:mod:`hf_asymkv.bench.prompt_cache`). The file loads in Python with ``AsymKVCache.load(path, model.config)``.
"""

from __future__ import annotations

import sys

from ..core.registry import PRESET_NAMES
from .args import (
    add_model_args,
    add_threads_arg,
    at_least,
    existing_file,
    input_arg,
    load_model_from_args,
    output_file,
    set_threads,
)

__all__ = ["add_parser"]


def _read_messages(path: str) -> list:
    """Chat messages from a JSON file: a list of ``{"role": ..., "content": ...}`` objects (ValueError otherwise)."""
    import json
    from pathlib import Path

    try:
        messages = json.loads(Path(path).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"--messages: {path!r} is not JSON: {exc}") from None
    ok = isinstance(messages, list) and messages and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages)
    if not ok:
        raise ValueError(f"--messages: {path!r} must hold a non-empty JSON list of {{\"role\": ..., \"content\": ...}} "
                         "objects with string values")
    return messages


def _cmd_prompt_cache(args) -> int:
    import json
    import shlex
    from pathlib import Path

    from ..bench.prompt_cache import format_report, run_prompt_cache
    from ..core.fileio import atomic_write_text
    from ..evals.common import Heartbeat

    if args.max_tokens and args.messages:
        raise ValueError("--max-tokens cuts a --text document; shorten the --messages file instead")
    messages = _read_messages(args.messages) if args.messages else None
    text = Path(args.text).read_text(encoding="utf-8") if args.text else None
    set_threads(args.threads)
    model, tokenizer = load_model_from_args(args)
    source = args.text or args.messages
    command = shlex.join(["hf-asymkv", *args.argv])  # quoted: questions hold spaces
    report = run_prompt_cache(
        model, tokenizer, args.out, text=text, messages=messages, preset=args.preset, chunk=args.chunk,
        max_tokens=args.max_tokens, questions=tuple(args.question or ()), max_new_tokens=args.max_new_tokens,
        verify=args.verify, load_rss=args.load_rss, tick=None if args.quiet else Heartbeat("prompt-cache", every=0),
        quantize_sliding=args.quantize_sliding,
        metadata={"model": args.model, "source": Path(source).name, "preset": args.preset,
                  "command": command})
    print(format_report(report))
    if args.json:
        import torch

        meta = {"command": command, "model": args.model, "threads": torch.get_num_threads(),
                "torch": torch.__version__}
        atomic_write_text(args.json, json.dumps({"meta": meta, **report}, indent=1) + "\n")
    if args.verify and not all(a["same_as_in_memory"] for a in report["answers"]):
        print("error: an answer from the loaded file differs from the cache in memory", file=sys.stderr)
        return 1
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("prompt-cache", help="prefill a document once, save the cache to a file, answer questions from "
                                            "it (load + first token vs prefill)")
    add_model_args(p)
    source = p.add_mutually_exclusive_group(required=True)
    input_arg(p, "--text", check=existing_file, group=source, default=None,
              help="the document: a UTF-8 text file, encoded as the tokenizer does (special tokens included)")
    input_arg(p, "--messages", check=existing_file, group=source, default=None,
              help="the document as chat messages: a JSON list of {\"role\", \"content\"} objects, through the "
                   "tokenizer's chat template; questions are then new user turns")
    p.add_argument("--out", type=output_file, required=True, help="the prompt-cache file to write (.safetensors)")
    p.add_argument("--preset", choices=PRESET_NAMES, default="balanced",
                   help=f"cache preset, one of {', '.join(PRESET_NAMES)} (default balanced)")
    p.add_argument("--quantize-sliding", action="store_true",
                   help="quantize the sliding-window layers too (AsymKVConfig(quantize_sliding=True); Gemma-3, Mistral, "
                        "gpt-oss): by default they stay exact, as transformers keeps them")
    p.add_argument("--chunk", type=at_least(1, zero_ok=True), default=2048,
                   help="prefill in forwards of this many tokens, to bound the attention's memory (0: one forward; "
                        "default 2048)")
    p.add_argument("--max-tokens", type=at_least(1, zero_ok=True), default=0,
                   help="keep the first N tokens of a --text document (0: all; default 0)")
    p.add_argument("--question", action="append", default=None, metavar="TEXT",
                   help="a question answered from the loaded file (repeat for several; each loads the file afresh)")
    p.add_argument("--max-new-tokens", type=at_least(1), default=32, help="answer length limit in tokens (default 32)")
    p.add_argument("--verify", action="store_true",
                   help="also answer each question from the cache still in memory and check the tokens are the same "
                        "(exit 1 if not)")
    p.add_argument("--load-rss", action="store_true",
                   help="load the file once more in a fresh process and report its peak RSS growth")
    p.add_argument("--json", type=output_file, default=None, help="also write every figure to this JSON file")
    add_threads_arg(p)
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.set_defaults(func=_cmd_prompt_cache)

"""`hf-asymkv prompt-cache`: prefill a document once, save the cache, answer questions from the file; what it costs.

The run: the document (a text file, or chat messages) is prefilled into a preset's :class:`~hf_asymkv.AsymKVCache`
(in chunks of ``chunk`` tokens to bound the attention's memory; the chunks after the first read the quantized history),
saved (``cache.save``), and for each question loaded back (``AsymKVCache.load``) and answered greedily. Reported:

- **bytes**: the file, ``memory_footprint()["total"]``, and a bf16 ``DynamicCache`` holding the same tokens written
  with safetensors' ``save_file`` (its tensors' shapes: ``[B, H, T, D]`` K and V per full-attention layer, the
  sliding-window layers' windows as transformers keeps them; zeros, since the values do not change the size);
  the full-attention layers' bytes per token beside a bf16 ``DynamicCache``'s and mlx-lm's quantized cache at 8 and 4
  bits (computed from its format: ``bits / 8`` bytes per element plus a scale and a bias in the model's dtype per
  64 elements, :func:`mlx_bytes_per_element`);
- **time**: the prefill, the save, and per question the load and the first answer token (the question's forward over
  the loaded cache), with ``prefill / (load + first token)``: how much sooner the first answer token comes from the
  file than from prefilling the document again (the document's prefill; one without a file would also prefill the
  question, so the ratio is a lower bound). The page cache holds the file just written: a load from a cold disk adds
  the read;
- **continuity** (``verify``): the answer from a copy of the cache still in memory, and whether its tokens equal the
  loaded cache's;
- **load RSS** (``load_rss``): a fresh process loads the file; its peak RSS growth during the load (Linux's ``VmHWM``
  reset before it) and what stays resident, against the file's size.

Answers are greedy, one token per forward, as ``generate(do_sample=False)`` gives them.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ..core.cache import QUANTIZED_LAYERS, AsymKVCache
from ..core.compat import cache_kwargs

__all__ = ["DEFAULT_CHUNK", "MLX_GROUP_SIZE", "bf16_dynamic_cache_bytes", "document_ids", "format_report",
           "greedy_answer", "mlx_bytes_per_element", "prefill", "question_ids", "run_prompt_cache"]

DEFAULT_CHUNK = 2048
"""Tokens per prefill forward: the attention's scores are ``chunk x history`` per head instead of ``T x T``, and at least
``max_growth_tokens`` (256), so that the buffers grow by what comes in and hold no unused capacity."""
MLX_GROUP_SIZE = 64
"""mlx-lm's default ``kv_group_size`` (``mlx_lm/cache_prompt.py``, ``mlx_lm/generate.py``)."""


def document_ids(tokenizer, text: str | None = None, messages: list | None = None, max_tokens: int = 0
                 ) -> torch.Tensor:
    """``[1, T]`` ids of the document: ``text`` as the tokenizer encodes it (its special tokens included), cut to its first
    ``max_tokens`` (0: all), or ``messages`` through the tokenizer's chat template (no generation prompt).

    Raises:
        ValueError: neither or both given, ``max_tokens`` with messages (a cut template is no longer a conversation),
            or an empty document.
    """
    if (text is None) == (messages is None):
        raise ValueError("give the document as text or as chat messages (one of them)")
    if messages is not None:
        if max_tokens:
            raise ValueError("max_tokens cuts a text document; shorten the messages instead")
        ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=False, return_dict=False)
    else:
        ids = tokenizer(text)["input_ids"]
        ids = ids[:max_tokens] if max_tokens else ids
    if not len(ids):
        raise ValueError("the document encodes to no tokens")
    return torch.tensor([list(ids)], dtype=torch.long)


def question_ids(tokenizer, question: str, prefix: torch.Tensor, messages: list | None = None) -> torch.Tensor:
    """``[1, Q]`` ids that follow the document ``prefix`` ``[1, T]`` to ask ``question``: a new user turn and the
    assistant's start through the chat template (``messages``), or ``"\\n\\nQuestion: ...\\nAnswer:"`` after a text.

    Raises:
        ValueError: a chat template that refuses the question as a new user turn, or renders the conversation with it
            so that it no longer starts with the saved prompt (the cache could not be continued).
    """
    if messages is None:
        ids = tokenizer(f"\n\nQuestion: {question}\nAnswer:", add_special_tokens=False)["input_ids"]
        return torch.tensor([list(ids)], dtype=torch.long)
    try:
        full = tokenizer.apply_chat_template([*messages, {"role": "user", "content": question}], tokenize=True,
                                             add_generation_prompt=True, return_dict=False)
    except Exception as exc:  # a template's own refusal (e.g. roles that must alternate) is a jinja TemplateError
        raise ValueError(f"the chat template refuses the question as a new user turn after the saved messages "
                         f"({type(exc).__name__}: {exc}); end the messages with an assistant turn") from None
    n = prefix.shape[1]
    if list(full[:n]) != prefix[0].tolist():
        raise ValueError("the chat template renders the conversation with the question so that it does not start with "
                         "the saved messages' tokens: this template cannot continue a saved prompt")
    return torch.tensor([list(full[n:])], dtype=torch.long)


@torch.no_grad()
def prefill(model, ids: torch.Tensor, cache, chunk: int, tick: Callable[[str], None] | None = None) -> float:
    """Run ``ids`` ``[1, T]`` into ``cache`` in forwards of ``chunk`` tokens (0: one forward); the seconds it took."""
    step = chunk or ids.shape[1]
    start = time.perf_counter()
    for first in range(0, ids.shape[1], step):
        model(input_ids=ids[:, first:first + step], **cache_kwargs(cache), use_cache=True, logits_to_keep=1)
        if tick:
            tick(f"prefill {min(first + step, ids.shape[1])}/{ids.shape[1]} tokens")
    return time.perf_counter() - start


@torch.no_grad()
def greedy_answer(model, cache, ids: torch.Tensor, max_new_tokens: int, eos: set[int]
                  ) -> tuple[list[int], float, float]:
    """Greedy answer to ``ids`` ``[1, Q]`` continuing ``cache``: ``(tokens, seconds to the first token, seconds in all)``,
    ending at an ``eos`` token (included) or after ``max_new_tokens``."""
    start = time.perf_counter()
    logits = model(input_ids=ids, **cache_kwargs(cache), use_cache=True, logits_to_keep=1).logits  # as generate
    tokens = [int(logits[0, -1].argmax())]
    first = time.perf_counter() - start
    while len(tokens) < max_new_tokens and tokens[-1] not in eos:
        step = torch.tensor([[tokens[-1]]], device=ids.device)
        logits = model(input_ids=step, **cache_kwargs(cache), use_cache=True).logits
        tokens.append(int(logits[0, -1].argmax()))
    return tokens, first, time.perf_counter() - start


def _batch(layer) -> int:
    if hasattr(layer, "batch_size"):  # a static layer
        return layer.batch_size
    return next(buf.data.shape[0] for buf in layer.buffers().values() if buf.data is not None)


def _kv_shapes(cache) -> list[tuple[torch.Size, torch.Size]]:
    """``(K shape, V shape)`` per layer of a ``DynamicCache`` holding what ``cache`` holds."""
    shapes = []
    for layer, shape in zip(cache.layers, cache.shapes):
        if isinstance(layer, QUANTIZED_LAYERS) and layer.is_initialized:
            rows = (_batch(layer), shape.kv_heads, layer.dense_tokens())  # (a sliding layer's: its window - 1)
            shapes.append((torch.Size([*rows, shape.head_dim]), torch.Size([*rows, shape.value_head_dim or
                                                                            shape.head_dim])))
        elif isinstance(getattr(layer, "keys", None), torch.Tensor):
            shapes.append((layer.keys.shape, layer.values.shape))
    return shapes


def bf16_dynamic_cache_bytes(cache, folder: str | Path) -> int:
    """Size of the file safetensors' ``save_file`` writes for a bf16 ``DynamicCache`` holding ``cache``'s tokens (written
    in ``folder``, then removed)."""
    from safetensors.torch import save_file

    tensors = {}
    for i, (key, value) in enumerate(_kv_shapes(cache)):
        tensors[f"layers.{i}.keys"] = torch.zeros(key, dtype=torch.bfloat16)
        tensors[f"layers.{i}.values"] = torch.zeros(value, dtype=torch.bfloat16)
    fd, tmp = tempfile.mkstemp(prefix=".bf16_dynamic_cache.", suffix=".safetensors", dir=folder)
    os.close(fd)
    try:
        save_file(tensors, tmp)
        return os.path.getsize(tmp)
    finally:
        os.unlink(tmp)


def mlx_bytes_per_element(bits: int, group_size: int = MLX_GROUP_SIZE, scale_bytes: int = 2) -> float:
    """Bytes per K or V element in mlx-lm's ``QuantizedKVCache``: ``bits`` packed into uint32 words, one scale and one
    bias per ``group_size`` elements along head_dim, both in the model's dtype (``scale_bytes``: 2 for bf16/fp16)."""
    return bits / 8 + 2 * scale_bytes / group_size


def _full_attention_bytes(cache) -> tuple[int, int]:
    """``(bytes, dense elements per token)`` of the quantized full-attention layers (not quantized sliding ones)."""
    total = elements = 0
    for layer in cache.layers:
        if isinstance(layer, QUANTIZED_LAYERS) and layer.is_initialized and not layer.is_sliding:
            parts = layer.memory_footprint()
            total += sum(v for k, v in parts.items() if k != "unused_capacity")
            elements += layer.dense_elements() // max(1, int(layer.get_seq_length()))
    return total, elements


def run_prompt_cache(model, tokenizer, out: str | Path, *, text: str | None = None, messages: list | None = None,
                     preset: str = "balanced", chunk: int = DEFAULT_CHUNK, max_tokens: int = 0,
                     questions: tuple[str, ...] = (), max_new_tokens: int = 32, verify: bool = False,
                     load_rss: bool = False, metadata: dict[str, str] | None = None,
                     tick: Callable[[str], None] | None = None, quantize_sliding: bool = False) -> dict:
    """Prefill the document into a ``preset`` cache (its sliding-window layers quantized too with
    ``quantize_sliding``), save it to ``out``, answer each question from a fresh load of the file (see the module
    docstring); the figures as a dict (:func:`format_report` prints it)."""
    ids = document_ids(tokenizer, text, messages, max_tokens).to(model.device)
    asked = [(q, question_ids(tokenizer, q, ids, messages).to(model.device)) for q in questions]  # before the prefill
    cache = AsymKVCache.from_preset(preset, model.config, quantize_sliding=quantize_sliding)
    prefill_s = prefill(model, ids, cache, chunk, tick)
    start = time.perf_counter()
    path = cache.save(out, input_ids=ids, metadata=metadata)
    save_s = time.perf_counter() - start
    footprint = cache.memory_footprint()
    full_bytes, elements = _full_attention_bytes(cache)
    tokens = int(ids.shape[1])
    report = {"preset": preset + ("+sliding" if quantize_sliding else ""), "tokens": tokens, "chunk": chunk, "dtype": str(model.dtype).removeprefix("torch."),
              "file": str(path), "file_bytes": path.stat().st_size, "footprint_total": footprint["total"],
              "footprint_unused_capacity": footprint.get("unused_capacity", 0),
              "bf16_dynamic_cache_file_bytes": bf16_dynamic_cache_bytes(cache, Path(path).parent),
              "full_attention_bytes_per_token": full_bytes / tokens, "full_attention_elements_per_token": elements,
              "prefill_s": prefill_s, "save_s": save_s, "answers": []}
    eos = set(_eos_ids(model, tokenizer))
    for question, q_ids in asked:
        report["answers"].append(_answer(model, tokenizer, path, ids, q_ids, question, cache if verify else None,
                                         max_new_tokens, eos))
        if tick:
            tick(f"answered {len(report['answers'])}/{len(asked)} questions")
    if load_rss:
        report["load_rss"] = measure_load_rss(path, model.config, str(model.device))
    return report


def _eos_ids(model, tokenizer) -> list[int]:
    eos = model.generation_config.eos_token_id
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    return eos or ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])


def _answer(model, tokenizer, path: Path, ids: torch.Tensor, q_ids: torch.Tensor, question: str, in_memory,
            max_new_tokens: int, eos: set[int]) -> dict:
    """One question from a fresh load of ``path`` (and, given the cache still ``in_memory``, from a copy of it)."""
    full = torch.cat([ids, q_ids], dim=1)
    start = time.perf_counter()
    loaded = AsymKVCache.load(path, model.config, input_ids=full, device=model.device)
    load_s = time.perf_counter() - start
    tokens, first_s, answer_s = greedy_answer(model, loaded, q_ids, max_new_tokens, eos)
    answer = {"question": question, "question_tokens": int(q_ids.shape[1]), "load_s": load_s,
              "first_token_s": first_s, "answer_s": answer_s, "answer_tokens": tokens,
              "answer": tokenizer.decode(tokens, skip_special_tokens=True)}
    if in_memory is not None:
        kept, _, _ = greedy_answer(model, copy.deepcopy(in_memory), q_ids, max_new_tokens, eos)
        answer["same_as_in_memory"] = kept == tokens
    return answer


def format_report(report: dict) -> str:
    """The figures of :func:`run_prompt_cache` as lines of text."""
    mib = 2**20
    file_bytes, total, bf16 = report["file_bytes"], report["footprint_total"], report["bf16_dynamic_cache_file_bytes"]
    per_element = report["full_attention_bytes_per_token"] / report["full_attention_elements_per_token"]
    lines = [f"prompt cache: {report['file']} ({report['preset']}, {report['tokens']} tokens, {report['dtype']} model)",
             f"  file                     {file_bytes:>12,d} B  ({file_bytes / mib:.2f} MiB)",
             f"  memory_footprint total   {total:>12,d} B  (file / total = {file_bytes / total:.4f})",
             f"  bf16 DynamicCache file   {bf16:>12,d} B  ({bf16 / file_bytes:.2f}x the file)",
             f"  full-attention layers    {report['full_attention_bytes_per_token']:.1f} B/token = "
             f"{per_element:.3f} B/element (bf16 2, mlx-lm 8-bit {mlx_bytes_per_element(8):.4f}, "
             f"4-bit {mlx_bytes_per_element(4):.4f})",
             f"  prefill {report['prefill_s']:.2f} s (chunks of {report['chunk'] or report['tokens']}), save "
             f"{report['save_s']:.3f} s"]
    for a in report["answers"]:
        to_first = a["load_s"] + a["first_token_s"]
        same = {True: ", same tokens as the cache in memory", False: ", OTHER tokens than the cache in memory",
                None: ""}[a.get("same_as_in_memory")]
        lines += [f"  Q: {a['question']}",
                  f"     load {a['load_s']:.3f} s + first answer token {a['first_token_s']:.3f} s = {to_first:.3f} s: "
                  f"{report['prefill_s'] / to_first:.0f}x sooner than the prefill{same}",
                  f"  A: {a['answer'].strip()}"]
    if "load_rss" in report:
        rss = report["load_rss"]
        lines.append(f"  load in a fresh process: {rss['load_s']:.3f} s, peak RSS +{rss['peak_rss_growth_bytes'] / mib:.1f} "
                     f"MiB ({rss['peak_rss_growth_bytes'] / file_bytes:.2f}x the file), resident after "
                     f"+{rss['rss_growth_bytes'] / mib:.1f} MiB")
    return "\n".join(lines)


def measure_load_rss(path: str | Path, config, device: str = "cpu") -> dict:
    """Load ``path`` in a fresh Python process: ``{"load_s", "rss_before_bytes", "peak_rss_growth_bytes",
    "rss_growth_bytes", "tokens"}``: the resident set before the load (torch, transformers and the config loaded),
    its peak during the load and what stays resident after it, less that."""
    with tempfile.TemporaryDirectory() as folder:
        config.save_pretrained(folder)
        out = subprocess.run([sys.executable, "-m", "hf_asymkv.bench.prompt_cache", str(path), folder, device],
                             capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _status_bytes(field: str) -> int:
    """``VmRSS`` / ``VmHWM`` of this process from ``/proc/self/status``, in bytes (Linux)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(f"{field}:"))


def _load_in_this_process(path: str, config_folder: str, device: str) -> dict:
    from transformers import AutoConfig

    import hf_asymkv.core.prompt_cache  # noqa: F401  (imported before the measure)

    config = AutoConfig.from_pretrained(config_folder)
    before = _status_bytes("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:  # the peak (VmHWM) starts again from the current RSS (Linux >= 4.0)
        f.write("5")
    start = time.perf_counter()
    cache = AsymKVCache.load(path, config, device=device)
    seconds = time.perf_counter() - start
    return {"load_s": seconds, "rss_before_bytes": before, "peak_rss_growth_bytes": _status_bytes("VmHWM") - before,
            "rss_growth_bytes": _status_bytes("VmRSS") - before, "tokens": int(cache.get_seq_length())}


def main(argv: list[str]) -> int:
    """``python -m hf_asymkv.bench.prompt_cache FILE CONFIG_FOLDER DEVICE``: what :func:`measure_load_rss` runs."""
    print(json.dumps(_load_in_this_process(*argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

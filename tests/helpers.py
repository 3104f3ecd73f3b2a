"""Plain helpers shared by several test modules (fixtures live in conftest.py)."""

import copy
import dataclasses
import importlib.util
import warnings
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

from hf_asymkv import AsymKVCache, cache_kwargs
from hf_asymkv.core.config import Growth, LayerConfig
from hf_asymkv.core.quant import QuantSpec


def layer_config(key_spec: QuantSpec, value_spec: QuantSpec, block_size: int, *, growth_factor: float = 1.25,
                 max_growth_tokens: int = 256, **settings) -> LayerConfig:
    """A :class:`LayerConfig` from hand-made specs, both put in blocks of ``block_size``; ``settings``: the other
    LayerConfig fields (``residual_length``, ``sink_tokens``, ``overflow_policy``)."""
    specs = (dataclasses.replace(spec, block_size=block_size) for spec in (key_spec, value_spec))
    return LayerConfig(*specs, growth=Growth(growth_factor, max_growth_tokens), **settings)


def greedy_with_logits(model, prompt: torch.Tensor, cache, n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy ``generate`` with ``cache``: ``(sequences [B, T + n], logits [n, B, vocab])``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model.generate(prompt, **cache_kwargs(cache), max_new_tokens=n, do_sample=False,
                             return_dict_in_generate=True, output_logits=True)
    return out.sequences, torch.stack(out.logits)


def manual_greedy(forward, prompt: torch.Tensor, cache, steps: int) -> tuple[torch.Tensor, list[int]]:
    """Prefill ``prompt`` ``[1, T]`` through ``forward`` (``model.forward`` or a compiled one) and take ``steps`` greedy
    steps, one token each: ``(last prefill logits [1, vocab], generated token ids)``. transformers' recipe for a
    compiled static cache, prefill included (``generate`` compiles only the one-token steps)."""
    tokens = []
    with torch.no_grad():
        logits = forward(input_ids=prompt, **cache_kwargs(cache)).logits
        first = logits[:, -1].clone()
        for _ in range(steps):
            token = logits[:, -1:].argmax(-1)
            tokens.append(int(token))
            logits = forward(input_ids=token, **cache_kwargs(cache)).logits
    return first, tokens


def _generate_compile_config(backend: str = "inductor"):
    from transformers import CompileConfig

    config = CompileConfig(fullgraph=True, dynamic=False, mode="default", backend=backend)  # reduce-overhead: CUDA graphs
    config._compile_all_devices = True  # transformers' switch for compiling on CPU
    return config


def _generate(model, prompt: torch.Tensor, cache, steps: int, compiled: bool, backend: str = "inductor"
              ) -> torch.Tensor:
    kwargs = {"compile_config": _generate_compile_config(backend)} if compiled else {"disable_compile": True}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model.generate(prompt, **cache_kwargs(cache), max_new_tokens=steps, do_sample=False, **kwargs)


def check_generate_compile(model, prompt: torch.Tensor, preset: str, steps: int, backend: str = "inductor",
                           **settings) -> None:
    """``generate``'s own compile of a static cache (one-token steps compiled with ``fullgraph=True``, the prefill
    eager): the eager static and the dynamic caches' tokens, one graph for every step across block flushes (at least
    3 flushes per layer inside the steps with ``settings`` of 8-token blocks), none for a second cache. ``backend=
    "eager"`` checks dynamo's tracing alone (what transformers' release decides: graph breaks, guards) in seconds;
    inductor adds its code generation (tens of seconds cold)."""
    def static():
        return AsymKVCache.from_preset(preset, model.config, max_cache_len=prompt.shape[1] + steps, **settings)

    dynamic = _generate(model, prompt, AsymKVCache.from_preset(preset, model.config, **settings), steps, False)
    eager = _generate(model, prompt, static(), steps, False)
    torch._dynamo.reset()
    counters.clear()
    cache = static()
    compiled = _generate(model, prompt, cache, steps, True, backend)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    # the prefill flushes once per layer: the others ran inside the compiled steps
    assert cache.stats()["flushes"] >= 3 * len(cache.layers)
    counters.clear()
    again = _generate(model, prompt, static(), steps, True, backend)
    assert not counters["stats"]["unique_graphs"]  # a new cache of the same shape reuses the graph
    assert torch.equal(compiled, eager) and torch.equal(compiled, dynamic) and torch.equal(again, compiled)


def first_layers(model, layers: int):
    """A copy of ``model`` with its first ``layers`` decoder layers (``model`` keeps all of them): the default model's
    shapes and weights at a compile's fraction of the cost."""
    kept = model.model.layers
    model.model.layers = kept[:layers]
    try:
        cut = copy.deepcopy(model)
    finally:
        model.model.layers = kept
    cut.config.num_hidden_layers = layers
    if getattr(cut.config, "layer_types", None):
        cut.config.layer_types = cut.config.layer_types[:layers]
    return cut


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """``max |got - expected| / max |expected|``."""
    return float((got - expected).abs().max() / expected.abs().max())


def check_whole_forward(model, prompt, preset: str, steps: int, backend: str = "inductor", **settings) -> None:
    """``torch.compile(model.forward, fullgraph=True, dynamic=False)`` with a static cache, prefill included: the
    prefill's last logits within 1e-4 (relative) of the eager static cache's, ``steps`` greedy tokens equal to the
    eager static and dynamic caches', two graphs (prefill, decode step) and none more for a second cache.
    ``backend="eager"``: dynamo's tracing alone (see :func:`check_generate_compile`).

    Regression for issue 38: inductor computed the prefill's keys straight into the buffer it then scattered them
    within, so a prefill with sinks read tokens it had just overwritten (logits off by 0.4-20)."""
    def static():
        return AsymKVCache.from_preset(preset, model.config, max_cache_len=prompt.shape[1] + steps + 1, **settings)

    dynamic_first, dynamic_tokens = manual_greedy(model.forward, prompt, AsymKVCache.from_preset(
        preset, model.config, **settings), steps)
    eager_first, eager_tokens = manual_greedy(model.forward, prompt, static(), steps)
    torch._dynamo.reset()
    counters.clear()
    forward = torch.compile(model.forward, fullgraph=True, dynamic=False, backend=backend)
    cache = static()
    first, tokens = manual_greedy(forward, prompt, cache, steps)
    assert counters["stats"]["unique_graphs"] == 2 and not counters["graph_break"]
    assert cache.stats()["blocks_quantized"] > 0
    assert relative_error(first, eager_first) <= 1e-4, preset
    assert tokens == eager_tokens == dynamic_tokens, preset
    counters.clear()
    again_first, again = manual_greedy(forward, prompt, static(), steps)
    assert not counters["stats"]["unique_graphs"]  # a new cache of the same shape reuses both graphs
    assert again == tokens and torch.equal(again_first, first)


def char_tokenizer():
    """An offline character-level tokenizer for the tiny models: ids 3..98 are printable ASCII and newline
    (inside the 256-token vocabulary), 0/1/2 are unk/bos/eos; decoding joins characters back exactly."""
    from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    core = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", bos_token="<s>", eos_token="</s>")


LOCAL_TEXT = " ".join(f"Line {i} of the local text says that the {w} is {c}." for i, (w, c) in enumerate(
    zip(["cat", "river", "lamp", "door", "tree"] * 40, ["red", "slow", "warm", "shut", "tall"] * 40)))
"""200 short sentences: a local text for the evaluations that cut windows of natural text (ppl, long decode)."""

WORDS = [f"w{i}" for i in range(200)]  # ids 3..202, inside the tiny models' 256-token vocabulary
TEXT_WORDS = 1500


def word_tokenizer():
    """A word-level tokenizer over :data:`WORDS`, built in memory: no download."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    core = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", bos_token="<s>", eos_token="</s>")


def load_script(name: str):
    """``scripts/<name>.py`` imported as a module (scripts are not a package), for the script smoke tests;
    ``name`` may name a subfolder (``studies/key_format``)."""
    path = Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(Path(name).name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cli_exit_code(argv: list[str]) -> int:
    """The exit code of ``hf-asymkv ARGV``, whether the command returned it or argparse exited with it (a value
    refused while parsing)."""
    from hf_asymkv.cli import main

    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code


def permissions_enforced() -> bool:
    """Whether this process is refused a folder without write permission (not when root bypasses modes; root
    without CAP_DAC_OVERRIDE, e.g. under ``setpriv --inh-caps=-dac_override``, is refused)."""
    import os
    import stat
    import tempfile

    with tempfile.TemporaryDirectory() as root:
        locked = os.path.join(root, "locked")
        os.mkdir(locked, stat.S_IRUSR | stat.S_IXUSR)
        try:
            return not os.access(locked, os.W_OK)
        finally:
            os.chmod(locked, stat.S_IRWXU)


def refuse_network(monkeypatch) -> None:
    """Make every connection attempt fail the test (the offline evaluations must not need one)."""
    import socket

    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args[1:] if len(args) > 1 else args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def tiered(values, fast, reason: str, ids=None) -> list:
    """``parametrize`` values, those whose id is in ``fast`` in the fast tier and the others marked ``slow`` with
    ``reason`` (which names the fast twin, usually the same test's fast cases). Ids are ``ids`` or each value's
    ``str``; a tuple value fills several argument names.

    Example::

        @pytest.mark.parametrize("name", tiered(PRESETS, {"balanced"}, "interpreter; fast twin: tests/x.py::test_y"))
    """
    values = list(values)
    ids = [str(v) for v in values] if ids is None else list(ids)
    unknown = set(fast) - set(ids)
    if unknown:
        raise ValueError(f"tiered: fast cases {sorted(unknown)} are not among the ids {ids}")
    slow = pytest.mark.slow(reason=reason)
    return [pytest.param(*(v if isinstance(v, tuple) else (v,)), id=i, marks=() if i in fast else slow)
            for v, i in zip(values, ids)]

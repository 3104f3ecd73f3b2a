"""Plain helpers shared by several test modules (fixtures live in conftest.py)."""

import dataclasses
import importlib.util
import warnings
from pathlib import Path

import torch

from hf_asymkv import cache_kwargs
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

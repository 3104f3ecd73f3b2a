"""Plain helpers shared by several test modules (fixtures live in conftest.py)."""

import importlib.util
import warnings
from pathlib import Path

import torch

from hf_asymkv import cache_kwargs


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
    """``scripts/<name>.py`` imported as a module (scripts are not a package), for the script smoke tests."""
    path = Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

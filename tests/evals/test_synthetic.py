"""The article's synthetic head (d=128, 4096 tokens, outlier channels 7/23/88 x20) with our quantizers."""

import pytest

from hf_asymkv.evals.synthetic import SYNTHETIC_SCHEMES, format_synthetic, run_synthetic


@pytest.fixture(scope="module")
def rows():
    return {r.scheme: r for r in run_synthetic(seeds=3)}


def test_every_scheme_is_measured(rows):
    assert set(rows) == set(SYNTHETIC_SCHEMES)
    assert all(r.seeds == 3 for r in rows.values())


def test_key_error_dominates_per_tensor_int8(rows):
    """The article's reading: with per-tensor INT8, nearly all output error comes from K."""
    both, k_only = rows["K+V per-tensor INT8"], rows["K per-tensor only INT8 (V exact)"]
    v_only = rows["V per-token only INT8 (K exact)"]
    assert k_only.out_err_mean > 10 * v_only.out_err_mean
    assert abs(both.out_err_mean - k_only.out_err_mean) < 0.1 * both.out_err_mean
    assert v_only.max_logit_err_mean == 0.0


def test_per_channel_keys_cut_the_error_five_fold(rows):
    assert rows["K per-channel, V per-token INT8"].out_err_mean * 5 < rows["K+V per-tensor INT8"].out_err_mean


def test_int8_blocks_keep_logits_closer_than_fp8_and_int4(rows):
    ours = rows["ours: K int8 per-channel/128-block, V int4 per-token"].max_logit_err_mean
    assert ours < rows["K fp8-e4m3 per-channel/128-block, V int4 per-token"].max_logit_err_mean
    assert ours < rows["K int4 per-channel/128-block, V int4 per-token (sym K4V4)"].max_logit_err_mean
    assert ours < rows["K per-channel, V per-token INT8"].max_logit_err_mean  # 128-token blocks beat one range


def test_table_puts_the_article_beside_ours(rows):
    table = format_synthetic(list(rows.values()))
    assert "0.1049" in table and "0.862" in table
    assert table.count("\n") == len(rows) + 1


def test_cli_eval_synthetic_writes_json_and_table(tmp_path, capsys):
    from hf_asymkv.cli import main

    assert main(["eval", "synthetic", "--seeds", "2", "--out", str(tmp_path)]) == 0
    assert "article: output error" in capsys.readouterr().out
    assert (tmp_path / "synthetic.json").is_file() and (tmp_path / "synthetic.md").is_file()


def test_cli_eval_synthetic_rejects_zero_seeds(tmp_path, capsys):
    from hf_asymkv.cli import main

    with pytest.raises(SystemExit) as info:  # refused while parsing: nothing runs
        main(["eval", "synthetic", "--seeds", "0", "--out", str(tmp_path)])
    assert info.value.code == 2
    assert "argument --seeds: must be >= 1, got 0" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())

"""scripts/decode_bench.py: a tiny run prints one row per width; bad flags exit 2 with argparse's message."""

from __future__ import annotations

import pytest
from helpers import load_script


@pytest.fixture(scope="module")
def decode_bench():
    return load_script("decode_bench")


def test_small_run_prints_every_width(decode_bench, capsys, single_thread):
    decode_bench.main(["--tokens", "64", "--block", "32", "--repeats", "2"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "ms" not in line]
    assert [r.split("|")[1].strip() for r in rows] == ["2", "3", "4", "5", "6", "8"]
    assert all(float(r.split("|")[2]) > 0 for r in rows)


@pytest.mark.parametrize("argv, message", [
    (["--tokens", "100", "--block", "32"], "--tokens must be a multiple of --block"),
    (["--block", "0"], "--block must be >= 1, got 0"),
    (["--repeats", "0"], "--repeats must be >= 1, got 0"),
], ids=["partial-block", "zero-block", "zero-repeats"])
def test_bad_flags_exit_2(decode_bench, argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        decode_bench.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err

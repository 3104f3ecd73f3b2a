"""``HF_ASYMKV_REQUIRE_KVPRESS``: the kvpress tests skip without kvpress in the main suite, fail without it where CI
requires it (.ci/run step 4), and a bad value is refused. kvpress is hidden by a package on ``PYTHONPATH`` whose
import fails, so these run in any venv, with kvpress installed or not."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _collect(tmp_path: Path, require: str | None) -> subprocess.CompletedProcess:
    shadow = tmp_path / "shadow" / "kvpress"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'kvpress' (hidden by the test)\", name='kvpress')\n")
    env = {k: v for k, v in os.environ.items() if k != "HF_ASYMKV_REQUIRE_KVPRESS"}
    env["PYTHONPATH"] = os.pathsep.join([str(shadow.parent), str(ROOT)])
    if require is not None:
        env["HF_ASYMKV_REQUIRE_KVPRESS"] = require
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                           "tests/integrations/test_kvpress.py"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


# A collection that gets as far as importing our kvpress tests imports torch and transformers in a new process (~30 s
# of CPU): the fast tier keeps the bad value, refused before that.
SLOW = pytest.mark.slow(reason="collects the kvpress tests in a new python (imports torch and transformers); fast twin: "
                               "tests/integrations/test_kvpress_required.py::test_the_kvpress_tests_skip_or_fail_as_required")


@pytest.mark.parametrize("require, code, message", [
    pytest.param(None, 5, r"SKIPPED .*kvpress is not installed: pip install kvpress", marks=SLOW, id="unset-skips"),
    pytest.param("1", 2, r"MissingExtraError: presses come from NVIDIA kvpress, which is not installed \(No module "
                 r"named 'kvpress' \(hidden by the test\)\)", marks=SLOW, id="1-fails"),
    pytest.param("yes", 2, r"HF_ASYMKV_REQUIRE_KVPRESS must be '0' .* or '1' .*, got 'yes'", id="bad-value"),
])
def test_the_kvpress_tests_skip_or_fail_as_required(tmp_path, require, code, message):
    """Exit code 5: the module skipped, nothing ran; 2: collection failed."""

    done = _collect(tmp_path, require)
    out = done.stdout + done.stderr
    assert done.returncode == code, out[-2000:]
    assert re.search(message, out), out[-2000:]

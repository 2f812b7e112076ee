"""The examples run as documented (on a CPU-only machine they take the reference path)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(*args):
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run([sys.executable, "-W", "ignore", *args], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=600)


def test_training_example_losses_match():
    result = _run("examples/train_llama.py", "--steps", "2", "--layers", "1")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "losses match step for step" in result.stdout


def test_custom_epilogue_example():
    result = _run("examples/custom_epilogue.py")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "program scaled_gelu_with_stats" in result.stdout and "# -- epilogue of" in result.stdout
    assert "max |amax - torch| =" in result.stdout

"""The README's example runs as written (on CPU it takes the reference path)."""

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_examples_run(capsys):
    """Every Python example, each in a fresh namespace."""
    first, training = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    exec(compile(first, "README.md", "exec"), {})
    assert "torch.Size([512, 384]) torch.Size([512])" in capsys.readouterr().out
    names = {}
    exec(compile(training, "README.md", "exec"), names)
    assert all(t.grad is not None for t in (names["x"], names["w"], names["bias"]))
    assert "d_bias = col_sum(" in capsys.readouterr().out


def test_readme_quick_start_commands_are_the_ci_ones():
    text = README.read_text()
    ci = (README.parent / ".ci" / "run").read_text()
    assert "python -m pytest -q -n auto" in text and "python -m pytest -q -n auto" in ci
    assert "pip install torch==2.13.0" in text and "torch==2.13.0" in ci

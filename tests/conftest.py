"""Shared fixtures for the CPU test suite (pytest markers live in pyproject.toml)."""

import importlib.util
import sys
import zlib
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run from a checkout that is not pip-installed
    sys.path.insert(0, str(ROOT))


@pytest.fixture
def gen(request) -> torch.Generator:
    """A CPU generator seeded from the test's id: fresh data per test, reproducible per run."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(scope="module")
def load_benchmark():
    """``load(name)``: benchmarks/<name>.py as a module, loaded once and registered under its name
    (dataclasses look their module up there)."""
    def load(name: str):
        if name not in sys.modules:
            spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
            sys.modules[name] = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(sys.modules[name])
        return sys.modules[name]
    return load

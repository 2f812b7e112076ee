"""Shared fixtures for the CPU test suite (pytest markers live in pyproject.toml)."""

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

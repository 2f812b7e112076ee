"""The backend seam: every arch a config may name has a backend, and an arch without one is
refused with the reason."""

import pytest

from coda_cute import UnsupportedError, library
from coda_cute.backends import Backend
from coda_cute.backends.registry import BACKENDS, backend
from coda_cute.config import ARCHS, KernelConfig
from coda_cute.lower import lower


def test_every_arch_has_a_backend():
    assert set(BACKENDS) == set(ARCHS)
    for arch, target in BACKENDS.items():
        assert isinstance(target, Backend) and target.arch == arch


def test_an_arch_without_a_backend_is_refused():
    with pytest.raises(UnsupportedError, match="sm_100a"):
        backend("sm_100a")
    with pytest.raises(UnsupportedError, match="sm_100a"):
        lower(library.get("gemm"), KernelConfig(arch="sm_100a"))

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
    with pytest.raises(UnsupportedError, match="sm_120a"):
        backend("sm_120a")
    with pytest.raises(UnsupportedError, match="sm_120a"):
        lower(library.get("gemm"), KernelConfig(arch="sm_120a"))


def test_the_lowering_spells_no_fragment_scheme():
    """Which accumulator values a thread holds and how threads exchange them is the backend's
    (backends/sm90.py); the lowering reaches them only through the Backend interface."""
    from pathlib import Path

    import coda_cute.lower

    source = Path(coda_cute.lower.__file__).read_text()
    for hopper in ("mma_m", "m_block", "shuffle_sync", "EPI_N // 8", "range_constexpr(1, 3)"):
        assert hopper not in source, f"lower.py spells {hopper!r}: move it behind the backend"

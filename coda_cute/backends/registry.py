"""The backend of each arch a ``KernelConfig`` may name."""

from __future__ import annotations

from ..errors import UnsupportedError
from . import Backend
from .sm90 import SM90
from .sm100 import SM100

BACKENDS: dict[str, Backend] = {backend.arch: backend for backend in (SM90(), SM100())}


def backend(arch: str) -> Backend:
    """The backend that builds kernels for ``arch``."""
    if arch not in BACKENDS:
        raise UnsupportedError(f"arch {arch!r} has no backend; supported: {', '.join(BACKENDS)}")
    return BACKENDS[arch]

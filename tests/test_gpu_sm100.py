"""sm_100a kernels on a Blackwell GPU (B200, GB200): the library and random compositions against
the reference interpreter, shapes ragged against every tile, outputs poisoned and guard bands
checked (`test_gpu_kernels.run_and_compare`, as on Hopper).  They skip on any other GPU: no
Blackwell GPU has run them yet; tests/test_sm100.py compiles these kernels without one."""

import pytest
import torch

from coda_cute import library
from coda_cute.config import KernelConfig
from coda_cute.errors import UnsupportedError
from coda_cute.lower import lower

from random_programs import random_programs
from test_compile import _lowerable
from test_gpu_kernels import SHAPES, run_and_compare


def _blackwell() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (10, 0)


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _blackwell(), reason="needs a Blackwell (sm_100) GPU")]

TILES = [(128, 256), (128, 128)]


BLACKWELL = KernelConfig(arch="sm_100a", gpu="B200", tile=TILES[0], cluster=(1, 1))


def _builds(program) -> bool:
    try:
        lower(program, BLACKWELL)
        return True
    except UnsupportedError:
        return False


LIBRARY = _lowerable(BLACKWELL)
RANDOM = [program for program in random_programs(40) if _builds(program)][:8]


@pytest.mark.parametrize("tile", TILES, ids=lambda t: f"{t[0]}x{t[1]}")
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", LIBRARY)
def test_library_program_on_blackwell(name, shape, tile):
    run_and_compare(library.get(name), *shape, tile=tile, cluster=(1, 1), schedule="cooperative", arch="sm_100a")


@pytest.mark.parametrize("program", RANDOM, ids=lambda p: p.name)
def test_random_composition_on_blackwell(program):
    run_and_compare(program, 300, 528, 200, tile=TILES[0], cluster=(1, 1), schedule="cooperative", arch="sm_100a")


def test_the_sample_covers_the_library():
    assert len(LIBRARY) >= 18 and len(RANDOM) == 8

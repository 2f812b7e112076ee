"""sm_100a kernels on a Blackwell GPU (B200, GB200): the library and random compositions (tables
and segment reductions among them) against the reference interpreter, shapes ragged against
every tile, outputs poisoned and guard bands checked (`test_gpu_kernels.run_and_compare`, as on
Hopper).  They skip on any other GPU: no Blackwell GPU has run them yet; tests/test_sm100.py
compiles these kernels without one."""

import pytest
import torch

from coda_cute import library
from coda_cute.config import KernelConfig
from coda_cute.errors import UnsupportedError
from coda_cute.lower import lower

from random_programs import random_programs
from test_compile import _lowerable
from test_gpu_kernels import SHAPES, _sized, run_and_compare


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
RANDOM = ([program for program in random_programs(40) if _builds(program)][:8]
          + [program for program in random_programs(40, extras=True) if _builds(program)][:4])  # tables, segments


@pytest.mark.parametrize("tile", TILES, ids=lambda t: f"{t[0]}x{t[1]}")
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", LIBRARY)
def test_library_program_on_blackwell(name, shape, tile):
    run_and_compare(_sized(name, shape[1]), *shape, tile=tile, cluster=(1, 1), schedule="cooperative", arch="sm_100a")


@pytest.mark.parametrize("tile", TILES, ids=lambda t: f"{t[0]}x{t[1]}")
def test_qk_rmsnorm_llama_heads_on_blackwell(tile):
    """head_dim 128: each head's 4 subtiles re-read from TMEM at its first subtile."""
    run_and_compare(library.get("qk_rmsnorm"), 333, 768, 128, tile=tile, cluster=(1, 1), schedule="cooperative",
                    arch="sm_100a")


@pytest.mark.parametrize("program", RANDOM, ids=lambda p: p.name)
def test_random_composition_on_blackwell(program):
    segments = any(node.op == "segreduce" for node in program.nodes)
    n = 512 if segments else 528  # N a whole number of segments (up to 128 columns)
    run_and_compare(program, 300, n, 200, tile=TILES[0], cluster=(1, 1), schedule="cooperative", arch="sm_100a")


def test_the_sample_covers_the_library():
    assert set(LIBRARY) == set(library.programs()) and len(RANDOM) == 12

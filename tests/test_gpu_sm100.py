"""sm_100a kernels on a Blackwell GPU (B200, GB200): the library and random compositions (tables
and segment reductions among them) against the reference interpreter, shapes ragged against
every tile, outputs poisoned and guard bands checked (`test_gpu_kernels.run_and_compare`, as on
Hopper; partials per 128-row CTA tile).  Every library program runs at the 1-CTA tiles and at
both CTA-pair tiles (cluster 2x1; M = 1, 129 and 300 leave a pair's second CTA, or a cluster's,
past M); a sample covering every primitive runs at the 1-CTA clusters with multicast.  They
skip on any other GPU: no Blackwell GPU has run them yet; tests/test_sm100.py compiles these
kernels without one."""

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
# (tile, cluster): 1-CTA tiles alone, CTA pairs (tcgen05 cta_group 2), 1-CTA clusters multicasting B or A
CONFIGS = [(TILES[0], (1, 1)), (TILES[1], (1, 1)), ((256, 128), (2, 1)), ((256, 256), (2, 1))]
MULTICAST = [((128, 256), (2, 1)), ((128, 256), (1, 2)), ((128, 128), (2, 1))]
# coordinates and row vectors, row reductions with log-sum-exp, a tile input beside a column
# reduction, gathered tables, segment reductions, pairs with N/2 and N outputs, a scalar
SAMPLE = ["cross_entropy_bwd", "cross_entropy_stats_save", "rmsnorm_bwd_residual", "rope_qkv", "qk_rmsnorm",
          "swiglu_save", "alpha_beta"]


BLACKWELL = KernelConfig(arch="sm_100a", gpu="B200", tile=TILES[0], cluster=(1, 1))


def _builds(program) -> bool:
    """Whether it builds at both configurations the random compositions run at."""
    try:
        for tile, cluster in (CONFIGS[0], CONFIGS[2]):
            lower(program, BLACKWELL.with_(tile=tile, cluster=cluster))
        return True
    except UnsupportedError:
        return False


LIBRARY = _lowerable(BLACKWELL)
RANDOM = ([program for program in random_programs(40) if _builds(program)][:8]
          + [program for program in random_programs(40, extras=True) if _builds(program)][:4])  # tables, segments


def _ids(config) -> str:
    (m, n), (cm, cn) = config
    return f"{m}x{n}-{cm}x{cn}"


# every library program at the tiles alone and the CTA pairs; the sample at the multicast clusters
RUNS = [(name, config) for config in CONFIGS for name in LIBRARY] + \
       [(name, config) for config in MULTICAST for name in SAMPLE]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name,config", RUNS, ids=lambda v: _ids(v) if isinstance(v, tuple) else v)
def test_library_program_on_blackwell(name, config, shape):
    tile, cluster = config
    run_and_compare(_sized(name, shape[1]), *shape, tile=tile, cluster=cluster, schedule="cooperative", arch="sm_100a")


@pytest.mark.parametrize("config", CONFIGS, ids=_ids)
def test_qk_rmsnorm_llama_heads_on_blackwell(config):
    """head_dim 128: each head's 4 subtiles re-read from TMEM at its first subtile."""
    tile, cluster = config
    run_and_compare(library.get("qk_rmsnorm"), 333, 768, 128, tile=tile, cluster=cluster, schedule="cooperative",
                    arch="sm_100a")


@pytest.mark.parametrize("config", [CONFIGS[0], CONFIGS[2]], ids=_ids)
@pytest.mark.parametrize("program", RANDOM, ids=lambda p: p.name)
def test_random_composition_on_blackwell(program, config):
    segments = any(node.op == "segreduce" for node in program.nodes)
    n = 512 if segments else 528  # N a whole number of segments (up to 128 columns)
    tile, cluster = config
    run_and_compare(program, 300, n, 200, tile=tile, cluster=cluster, schedule="cooperative", arch="sm_100a")


def test_the_sample_covers_the_library():
    assert set(LIBRARY) == set(library.programs()) and len(RANDOM) == 12
    assert set(SAMPLE) <= set(LIBRARY)

"""Runs every library program once through its generated kernel, for compute-sanitizer.

    python tests/gpu_sanitize.py                                  # warm the kernel cache first
    compute-sanitizer --tool memcheck python tests/gpu_sanitize.py
    compute-sanitizer --tool racecheck python tests/gpu_sanitize.py
    python tests/gpu_sanitize.py 256x128                          # only the configurations with these tiles

Shapes are small and ragged (every tile edge is exercised); both schedules run, and tables
both gathered and staged in smem.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_gpu_kernels import _gpu_programs, _sized, make_inputs  # noqa: E402

from coda_cute.runtime import Kernel  # noqa: E402

# (schedule, tile, cluster, M, N): the last four have clusters that own tiles past M or N
CONFIGS = [("cooperative", (128, 128), (1, 1), 200, 272), ("pingpong", (64, 128), (1, 1), 200, 272),
           ("cooperative", (128, 256), (1, 2), 200, 528), ("pingpong", (64, 256), (2, 1), 300, 272),
           ("pingpong", (128, 128), (1, 2), 200, 528), ("pingpong", (128, 192), (1, 2), 200, 528),
           ("cooperative", (256, 128), (2, 1), 200, 272)]
TILES = sys.argv[1:]
for schedule, tile, cluster, m, n in CONFIGS:
    if TILES and f"{tile[0]}x{tile[1]}" not in TILES:
        continue
    for name in _gpu_programs():
        program = _sized(name, n)
        # tables of 37 rows are gathered; of 256 rows (a multiple of every tile's rows), staged in smem
        for rows in (37, 256) if any(op.kind == "table" for op in program.operands) else (37,):
            a, b, ops = make_inputs(program, m, n, 72, torch.bfloat16, torch.Generator().manual_seed(1), table_rows=rows)
            kernel = Kernel(program, tile=tile, cluster=cluster, schedule=schedule)
            kernel(a, b, **ops)
            torch.cuda.synchronize()
            print(f"{schedule:12s} {tile} {cluster} {name}{' (tables staged)' * kernel.last.config.stage_tables}: ok",
                  flush=True)

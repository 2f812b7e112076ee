"""Runs every library program once through its generated kernel, for compute-sanitizer.

    python tests/gpu_sanitize.py                                  # warm the kernel cache first
    compute-sanitizer --tool memcheck python tests/gpu_sanitize.py
    compute-sanitizer --tool racecheck python tests/gpu_sanitize.py

Shapes are small and ragged (every tile edge is exercised); both schedules run.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_gpu_kernels import _gpu_programs, _sized, make_inputs  # noqa: E402

from coda_cute.runtime import Kernel  # noqa: E402

for schedule, tile in (("cooperative", (128, 128)), ("pingpong", (64, 128))):
    for name in _gpu_programs():
        program = _sized(name, 272)
        a, b, ops = make_inputs(program, 200, 272, 72, torch.bfloat16, torch.Generator().manual_seed(1))
        Kernel(program, tile=tile, cluster=(1, 1), schedule=schedule)(a, b, **ops)
        torch.cuda.synchronize()
        print(f"{schedule:12s} {name}: ok", flush=True)

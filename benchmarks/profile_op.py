"""Where does a fused kernel's time go, beside our plain GEMM and cuBLAS on the same operands?  One
op of bench_sm90.py at one d, each launched once after a warm-up, inside a profiler range for
Nsight Compute to capture (`ncu --profile-from-start off`).

    ncu --profile-from-start off --set full -o report \\
        python benchmarks/profile_op.py --d 2048 --op "O GEMM + residual"

(`bash benchmarks/h200_run.sh profile 2048 O GEMM + residual` runs that and prints the report's
stalls per SASS instruction with benchmarks/ncu_stalls.py.)  The kernels come in this order:
the fused kernel (and any kernel finishing its reduction partials), our plain GEMM, cuBLAS.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_sm90 import SHAPES, ops_for  # noqa: E402

import coda_cute as cc  # noqa: E402
from coda_cute import library  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--d", type=int, default=2048, choices=sorted(SHAPES))
    parser.add_argument("--m", type=int, default=8192, help="tokens")
    parser.add_argument("--op", required=True, help="the bench_sm90 op of this name, or the one whose name starts with this")
    args = parser.parse_args()
    ops = ops_for(args.d, args.m)
    # the op named exactly, else the one whose name starts so ("down dgrad + SwiGLU bwd" is both)
    chosen = [op for op in ops if op[0] == args.op] or [op for op in ops if op[0].startswith(args.op)]
    if len(chosen) != 1:
        sys.exit(f"--op {args.op!r} names {len(chosen)} ops; one of: {', '.join(op[0] for op in ops)}")
    name, program, a, b, operands, _ = chosen[0]
    fused, plain = cc.Kernel(program), cc.Kernel(library.get("gemm"))
    launches = [lambda: fused(a, b, **operands), lambda: plain(a, b), lambda: a @ b.t()]
    for launch in launches * 3:  # compile, load, and warm the caches
        launch()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for launch in launches:
        launch()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print(f"profiled {name} at d = {args.d}: {fused.last.config.describe()}; then our GEMM, then cuBLAS")


if __name__ == "__main__":
    main()

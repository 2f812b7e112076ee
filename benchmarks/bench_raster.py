"""How the persistent tile scheduler's order affects our GEMMs at d = 4096 (M = 8192 tokens):
raster along M or N, swizzle 1/2/4/8, default tile and cluster otherwise, beside cuBLAS,
interleaved, median of 5 repetitions.  Label "M4" = raster along M, swizzle 4.  Plain-GEMM
outputs are checked against torch first.

    python benchmarks/bench_raster.py --out raster.json

`Kernel(program, raster_along_m=..., swizzle=...)` (and `coda-cute emit --raster --swizzle`)
set the order; the default is raster along M, swizzle 4 (results README).  The kernels walk a
swizzle in bands with the emitted `swizzled_tile`; the 2026-12-03 results were taken with CuTe
DSL's own swizzle (PersistentTileSchedulerParams), which rounds the cluster grid up to a
multiple of the swizzle (QKV at M8 ran a third more tiles).
"""

import argparse
import json
import platform
import shlex
import statistics
import sys
import time

import torch

from coda_cute import library
from coda_cute.runtime import Kernel


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="raster.json")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    from triton.testing import do_bench

    bf = torch.bfloat16
    m, d, ffn, qkv = 8192, 4096, 14336, 6144

    def weight(n, k):
        return torch.randn(n, k, device="cuda", dtype=bf) * k ** -0.5

    x = torch.randn(m, d, device="cuda", dtype=bf)
    h = torch.randn(m, ffn, device="cuda", dtype=bf)
    cases = [("gate/up", x, weight(2 * ffn, d), "gemm"), ("gate/up SwiGLU", x, weight(2 * ffn, d), "swiglu"),
             ("QKV", x, weight(qkv, d), "gemm"), ("down", h, weight(d, ffn), "gemm")]
    rows = []
    for name, a, b, program_name in cases:
        program = library.get(program_name)
        contenders = {"cuBLAS": lambda a=a, b=b: a @ b.t()}
        for raster_along_m in (True, False):
            for swizzle in (1, 2, 4, 8):
                kernel = Kernel(program, raster_along_m=raster_along_m, swizzle=swizzle)
                out = kernel(a, b)
                if program_name == "gemm":
                    want = (a @ b.t()).float()
                    err = ((out.float() - want).norm() / want.norm()).item()
                    assert err < 1e-2, f"{name} raster_along_m={raster_along_m} swizzle={swizzle}: error {err:.3g}"
                label = f"{'M' if raster_along_m else 'N'}{swizzle}"
                contenders[label] = lambda k=kernel, a=a, b=b: k(a, b)
        times = {c: [] for c in contenders}
        for _ in range(args.reps):
            for c, f in contenders.items():
                times[c].append(do_bench(f, warmup=25, rep=100))
        rows.append({"op": name, **{c: round(statistics.median(t), 3) for c, t in times.items()}})
        print(rows[-1], flush=True)
    meta = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "python": platform.python_version(), "command": "python " + " ".join(map(shlex.quote, sys.argv))}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

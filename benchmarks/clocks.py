"""Is a fused op slower than its GEMM by its own cycles, or because it runs at a lower SM clock?
SM clock and board power while one op of bench_sm90.py runs back to back: our fused kernel,
then our plain GEMM of the same operands (and cuBLAS).

    python benchmarks/clocks.py [--d 2048] [--ops "SwiGLU bwd" ...] [--seconds 2] [--out clocks.json]

The H200 runs GEMMs at its 700 W board limit, below its 1980 MHz top clock.  A fused epilogue
that moves more HBM traffic draws more of that budget, so the SM clock drops: a kernel can then
be slower than its GEMM by more than its epilogue's own cycles.  nvidia-smi samples clocks,
power and the throttle reasons every 50 ms; the table gives their medians and the time per call
over the same loop (no L2 flush between calls, unlike bench_sm90's timings).
"""

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_sm90 import SHAPES, _check, _write, ops_for  # noqa: E402

import coda_cute as cc  # noqa: E402
from coda_cute import library  # noqa: E402

QUERY = "clocks.sm,power.draw,clocks_event_reasons.active"


def sample(launch, seconds: float) -> dict:
    """Medians of nvidia-smi's samples while `launch` runs back to back for `seconds`."""
    launch()
    torch.cuda.synchronize()
    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-lms", "50"],
                           stdout=subprocess.PIPE, text=True)
    time.sleep(0.3)  # the first samples come before the loop
    start, calls = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        for _ in range(20):
            launch()
        torch.cuda.synchronize()
        calls += 20
    elapsed = time.perf_counter() - start
    smi.terminate()
    lines = smi.communicate()[0].strip().splitlines()
    fields = [line.split(", ") for line in lines[6:-2]]  # samples well inside the loop
    fields = [f for f in fields if len(f) == 3]
    if not fields:
        raise SystemExit(f"nvidia-smi gave no samples: {lines[:3]}")
    return {"sm_mhz": statistics.median(float(f[0]) for f in fields),
            "power_w": statistics.median(float(f[1]) for f in fields),
            "throttle_reasons": sorted({f[2] for f in fields}),
            "ms_per_call": 1000 * elapsed / calls}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--d", type=int, default=2048, choices=sorted(SHAPES))
    parser.add_argument("--m", type=int, default=8192, help="tokens")
    parser.add_argument("--ops", nargs="*", help="only the fused ops whose name contains one of these strings")
    parser.add_argument("--seconds", type=float, default=2.0, help="per contender")
    parser.add_argument("--out", default="clocks.json")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    rows = []
    plain = cc.Kernel(library.get("gemm"))
    for name, program, a, b, operands, fn in ops_for(args.d, args.m):
        if program.name == "gemm" or (args.ops and not any(o in name for o in args.ops)):
            continue
        fused = cc.Kernel(program)
        _check(name, fused(a, b, **operands), fn(a, b, **operands))  # the kernel computes the op
        row = {"d": args.d, "op": name, "M": args.m, "config": fused.last.config.describe()}
        for label, launch in (("coda-cute", lambda: fused(a, b, **operands)), ("coda-cute GEMM alone", lambda: plain(a, b)),
                              ("cuBLAS GEMM alone", lambda: a @ b.t())):
            row[label] = sample(launch, args.seconds)
        rows.append(row)
        ours, gemm = row["coda-cute"], row["coda-cute GEMM alone"]
        print(f"{name:36s} ours {ours['ms_per_call']:.4f} ms at {ours['sm_mhz']:.0f} MHz, {ours['power_w']:.0f} W | "
              f"our GEMM {gemm['ms_per_call']:.4f} ms at {gemm['sm_mhz']:.0f} MHz, {gemm['power_w']:.0f} W | "
              f"time x{ours['ms_per_call'] / gemm['ms_per_call']:.3f}, clock x{gemm['sm_mhz'] / ours['sm_mhz']:.3f}",
              flush=True)
        _write(args, rows)  # after every op, as bench_sm90 does


if __name__ == "__main__":
    main()

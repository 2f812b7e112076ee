"""What does the call path cost: cold compile, warm load from disk, host overhead per call?

    python benchmarks/bench_runtime.py [--out runtime.json]

- cold compile: lower + render + cute.compile (+ export) of each library kernel, memory and
  disk caches empty (the first call of a new key pays this): goal <= 2 s.  The tiny call
  compiles what such calls run (reductions finished in the GEMM: runtime.host_bound); for
  programs with reductions the kernel that larger calls run, with its finishing kernel, is
  compiled too (compile_finishing_kernel_s);
- warm load: a fresh process (after `import torch, cutlass` and CUDA context creation)
  importing coda_cute and loading the kernel from the disk cache, with Python bytecode
  cached as a pip installation has it: goal <= 30 ms after imports.  The load imports
  `tvm_ffi` (through cutlass's `load_module`), a dependency like torch and cutlass whose own
  import takes 20-40 ms: it is timed as a phase of its own (tvm_ffi_ms), and
  warm_load_after_imports_ms is the total less it.  A full garbage collection is run (and
  reported, gc_before_ms) before the clock starts: importing torch and cutlass leaves one due,
  and Python runs it (~100 ms on the H200's host) inside whichever import comes next;
- host overhead: CPU time per call of `Kernel(program)(a, b, ...)` on a tiny problem
  (argument checks, output allocation, launch), next to `a @ b.t()` (cuBLAS): goal within
  5 us of cuBLAS, reductions included; also the time per call up to the last kernel's end
  (GPU-bound for tiny launches).  Medians of ROUNDS rounds, the two contenders taking turns
  to go first, with Python's garbage collector off (one collection inside a loop of calls
  would land on one contender only; cuBLAS's own time once moved from 24 to 16 us between
  programs of one run).
"""

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from coda_cute import cache, library
from coda_cute.arguments import random_call
from coda_cute.runtime import Kernel

LOAD_SNIPPET = r"""
import gc, time, torch, cutlass
torch.empty(1, device="cuda")  # the CUDA context exists before any kernel loads
tg = time.perf_counter()
gc.collect()  # the full collection that importing torch and cutlass left due (not ours; reported apart)
gc_s = time.perf_counter() - tg
t0 = time.perf_counter()
from coda_cute import library
from coda_cute.cache import cache_key, get_kernel
from coda_cute.config import KernelConfig
t1 = time.perf_counter()
program, config = library.get({name!r}), KernelConfig(**{config!r})
t2 = time.perf_counter()
cache_key(program, config)  # versions and generator hash, once per process
t3 = time.perf_counter()
import tvm_ffi  # a dependency the load imports (through cutlass's load_module): timed apart
t4 = time.perf_counter()
entry = get_kernel(program, config)
t5 = time.perf_counter()
print(entry.origin, t5 - t0, t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, gc_s)
"""
ROUNDS = 11  # interleaved rounds of the per-call timings; their medians count
PHASES = ("import_ms", "library_ms", "key_ms", "tvm_ffi_ms", "load_ms", "gc_before_ms")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="runtime.json")
    parser.add_argument("--programs", nargs="*", help="library programs to compile and load (default: all)")
    parser.add_argument("--load-programs", nargs="*", default=["gemm", "swiglu_bwd", "cross_entropy_stats"],
                        help="programs whose warm load is timed in fresh processes")
    args = parser.parse_args()
    os.environ["CODA_CUTE_CACHE_DIR"] = tempfile.mkdtemp(prefix="coda_cute_bench_cache_")
    rows = []
    for name, program in library.programs().items():
        if args.programs and name not in args.programs:
            continue
        torch.manual_seed(0)
        a, b, ops = random_call(program, 128, 1024, 128, torch.bfloat16)
        kernel = Kernel(program)
        t0 = time.perf_counter()
        kernel(a, b, **ops)
        torch.cuda.synchronize()
        first_call = time.perf_counter() - t0
        config = kernel.last.config
        entry = cache.get_kernel(program, config)
        cfg = dict(config.__dict__)
        row = {"program": name, "compile_s": round(entry.seconds, 3), "first_call_s": round(first_call, 3)}
        if config.finish_in_gemm:
            row["compile_finishing_kernel_s"] = round(
                cache.get_kernel(program, config.with_(finish_in_gemm=False)).seconds, 3)
        if name in args.load_programs:
            # bytecode cached, as in any pip installation (the first, untimed run writes it; a
            # PYTHONDONTWRITEBYTECODE environment would otherwise recompile every module each time)
            env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
            loads = []
            for attempt in range(4):
                out = subprocess.run([sys.executable, "-c", LOAD_SNIPPET.format(name=name, config=cfg)],
                                     capture_output=True, text=True, env=env)
                if attempt == 0:
                    continue
                fields = out.stdout.split()[-(len(PHASES) + 2):]
                assert fields and fields[0] == "disk", out.stdout + out.stderr
                loads.append([float(x) for x in fields[1:]])
            loads.sort()  # by total: the median run's phases
            row["warm_load_ms"] = round(1000 * loads[1][0], 1)
            row.update({phase: round(1000 * t, 1) for phase, t in zip(PHASES, loads[1][1:])})
            # what is ours: the warm load less the dependency's import (as torch's and cutlass's)
            row["warm_load_after_imports_ms"] = round(row["warm_load_ms"] - row["tvm_ffi_ms"], 1)
        rows.append(row)
        print(rows[-1], flush=True)

    # per call on a tiny problem, two ways: "host" is the CPU time of issuing 200 calls (fewer
    # than the launch queue holds, so the CPU never waits for the GPU): checks, output
    # allocation, launch; "throughput" is 2000 calls to the last kernel's end, which the
    # GPU's own time per launch may bound instead
    a = torch.randn(128, 128, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(128, 128, device="cuda", dtype=torch.bfloat16)
    overhead = {}
    for label, program, ops in (("gemm", library.get("gemm"), {}),
                                ("bias_gelu", library.get("bias_gelu"), {"bias": torch.randn(128, device="cuda")}),
                                ("residual_sumsq", library.get("residual_sumsq"),
                                 {"residual": torch.randn(128, 128, device="cuda", dtype=torch.bfloat16)})):
        kernel = Kernel(program)
        kernel(a, b, **ops)
        samples = {f"{who} {how}": [] for who in ("coda-cute", "cuBLAS") for how in ("host", "throughput")}
        gc.collect()
        gc.disable()  # as timeit does: a collection inside one loop would land on one contender only
        for round_ in range(ROUNDS):
            contenders = [("coda-cute", lambda: kernel(a, b, **ops)), ("cuBLAS", lambda: a @ b.t())]
            for who, fn in contenders[round_ % 2:] + contenders[:round_ % 2]:  # each goes first in turn
                for how, calls in (("host", 200), ("throughput", 2000)):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(calls):
                        fn()
                    if how == "throughput":
                        torch.cuda.synchronize()
                    samples[f"{who} {how}"].append((time.perf_counter() - t0) / calls * 1e6)
        gc.enable()
        overhead[label] = {k: round(statistics.median(v), 2) for k, v in samples.items()}
        print(label, overhead[label], flush=True)
    meta = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "commit": os.environ.get("CODA_COMMIT", "unknown"), "command": "python " + " ".join(sys.argv)}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "kernels": rows, "host_overhead_us": overhead}, f, indent=1)


if __name__ == "__main__":
    main()

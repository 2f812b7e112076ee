"""Cold compile time of each library program's kernel for one call, on the CPU (no GPU needed).

    python benchmarks/bench_compile.py [--shape 128x1024x128] [--programs NAME ...]
                                       [--without-small-call-tile] [--rounds 2] [--out compile.json]

Each kernel is configured as a call of that shape configures it (``Kernel.config_for`` on CPU
tensors: tile, schedule, where reductions finish, the subtile loop's form; GPU model H200).
``--without-small-call-tile`` keeps every field of that call but the tile, cluster and schedule,
which it takes from the rules as if the call kept the GPU busy (``runtime.fill_config`` with
``small=False``): what small calls ran before ``runtime.SMALL_CALL_TILE``.  A time is the best of
``--rounds`` compiles (lower, render, ``cute.compile``), after one untimed compile that pays the
process's one-time costs; the rows also give the kernel's SASS length and stack frame.
``bench_runtime.py`` times compiles on a GPU host, inside the first call.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from coda_cute import library  # noqa: E402
from coda_cute.arguments import bind, random_call  # noqa: E402
from coda_cute.cache import short_config  # noqa: E402
from coda_cute.compile import compile_program  # noqa: E402
from coda_cute.config import KernelConfig  # noqa: E402
from coda_cute.errors import CodaError  # noqa: E402
from coda_cute.runtime import GPUS, Kernel, fill_config  # noqa: E402
from bench_block import write  # noqa: E402 - the result file


def call_config(program, m: int, n: int, k: int, without_small_call_tile: bool) -> KernelConfig:
    a, b, operands = random_call(program, m, n, k, torch.bfloat16, device="cpu")
    config = Kernel(program, gpu="H200").config_for(bind(program, a, b, operands))
    if without_small_call_tile:
        tile, cluster, schedule = fill_config(program, m, n, arch=config.arch, sms=GPUS[config.gpu], k=k)
        config = config.with_(tile=tuple(tile), cluster=tuple(cluster), schedule=schedule)
    return config.resolved(program)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="128x1024x128", help="the call, MxNxK (default: bench_runtime's)")
    parser.add_argument("--programs", nargs="*", help="library programs (default: all)")
    parser.add_argument("--without-small-call-tile", action="store_true",
                        help="the tile, cluster and schedule the rules give a call that keeps the GPU busy")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", help="write the rows as JSON")
    args = parser.parse_args(argv)
    m, n, k = (int(x) for x in args.shape.split("x"))
    os.environ.setdefault("CODA_CUTE_CACHE_DIR", tempfile.mkdtemp(prefix="coda_cute_bench_compile_"))
    compile_program(library.get("gemm"), KernelConfig(gpu="H200"))  # the process's one-time costs
    rows = []
    for name, program in library.programs().items():
        if args.programs and name not in args.programs:
            continue
        try:
            config = call_config(program, m, n, k, args.without_small_call_tile)
        except CodaError as e:  # a shape the program cannot take
            print(f"{name}: skipped ({e})", flush=True)
            continue
        seconds = []
        for _ in range(args.rounds):
            start = time.perf_counter()
            kernel = compile_program(program, config)
            seconds.append(time.perf_counter() - start)
        rows.append({"program": name, "config": short_config(config), "compile_s": round(min(seconds), 3),
                     "sass_instructions": kernel.instructions, "stack_frame_bytes": kernel.stack_frame_bytes})
        print(json.dumps(rows[-1]), flush=True)
    times = [row["compile_s"] for row in rows]
    print(f"{len(rows)} kernels: {min(times):.2f}-{max(times):.2f} s, median {statistics.median(times):.2f}")
    if args.out:
        write(args.out, rows, smoke=False, machine=f"{platform.machine()}, {os.cpu_count()} CPUs",
              extra={"shape": args.shape, "without_small_call_tile": args.without_small_call_tile})


if __name__ == "__main__":
    main()

"""Is a program nobody tuned as fast as the library's?  Fused GEMM + epilogue programs, the
library's and ones nobody wrote for it, against our own plain GEMM of the same operands and
against torch.compile of the same math unfused:

    python benchmarks/bench_programs.py --out programs.json                     # every program, both shapes
    python benchmarks/bench_programs.py --kinds library --shapes 8192x4096x4096 --out lib.json
    python benchmarks/bench_programs.py --kinds library derived --programs swiglu_bwd swiglu_backward
    python benchmarks/bench_programs.py --smoke --out /tmp/smoke.json           # CPU: the plumbing only

Programs (`--kinds`): `library`, every library program whose operands random inputs can fill
(`arguments.random_call`; not the RoPE tables' programs); `random`, compositions from the tests'
generator (tests/random_programs.py: elementwise ops, pairs, row and column reductions, tile
inputs); `transcendental`, epilogues made of exp, log, tanh, erf and sigmoid chains (below);
`derived`, the backward programs `cc.derive` makes from the library's forward programs (beside
the hand-written ones of `library`: swiglu's beside swiglu_bwd, cross_entropy_stats' beside
cross_entropy_bwd).

Per program and shape (`--shapes`, MxNxK: 8192x4096x4096 and the d = 2048 8192x2048x2048 by
default), timed interleaved as bench_block.py times steps (`time_interleaved`: do_bench's median
step after the clock settled, median over `--reps` rounds, each starting one contender later):
    fused           Kernel(program): the default configuration, whatever its rules pick
    fused autotune  Kernel(program, autotune=True): the fastest of the backend's candidates
    GEMM            our plain GEMM (library `gemm`) at the fused kernel's default configuration
    torch.compile   cuBLAS's GEMM, then the epilogue as PyTorch ops (the reference interpreter
                    traced by torch.compile, so Inductor fuses it into as few kernels as it can)
The fused kernels are checked against the reference before timing (relative norm < 2e-2).

Compiling is most of a run's time (autotune alone builds ~7 candidates per program), so on the
GPU every kernel the rows load (each program's default, its autotune candidates and the plain
GEMM beside it) is first built into the disk cache by `--jobs` worker processes
(`coda_cute.precompile`); the rows then load them.

The JSON: {"meta": {date, gpu, torch, commit, command}, "rows": [{"program", "kind", "shape",
"config" (the default's), "autotune_config", <contender>: {"ms", "spread"}, "fused_over_gemm",
"autotune_over_gemm", "compile_over_fused", "rel_err", "seconds": {"build", "timed"}}],
"precompile": {"kernels", "seconds", "failed"}}; the summary prints per kind the median and worst
fused / GEMM and every program torch.compile beats.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

# this checkout's coda_cute (the commit the result file names), and the tests' program generator
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
import coda_cute as cc  # noqa: E402
from coda_cute import library  # noqa: E402
from coda_cute.arguments import bind, random_call  # noqa: E402
from coda_cute.cache import short_config, tune_candidates  # noqa: E402
from coda_cute.errors import CodaError  # noqa: E402
from coda_cute.precompile import precompile_pairs  # noqa: E402
from coda_cute.reference import evaluate_accumulator  # noqa: E402
from random_programs import random_program  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_block import time_interleaved, write  # noqa: E402 - settled windows, interleaved rounds; the result file

SHAPES = ("8192x4096x4096", "8192x2048x2048")
KINDS = ("library", "random", "transcendental", "derived")
# forward programs whose derived backward the benchmark times (those the sm_90a lowering takes)
DERIVED_FROM = ("swiglu", "bias_gelu", "residual_sumsq", "rms_swiglu_save", "cross_entropy_stats")
CONTENDERS = ("fused", "fused autotune", "GEMM", "torch.compile")
RANDOM_SEEDS = tuple(range(12))
SMOKE_SHAPE = "64x64x32"


@cc.epilogue
def erf_gelu_gate(acc):
    """Exact GELU gate on interleaved pairs (erf), times the up half."""
    gate, up = cc.pairs(acc)
    return cc.gelu(gate) * up


@cc.epilogue
def tanh_soft_cap(acc, bias: cc.ColVec):
    """Soft-capped logits: 30 * tanh((acc + bias) / 30), and each row's log-sum-exp of them."""
    y = 30.0 * cc.tanh((acc + bias) / 30.0)
    return {"D": y, "lse": cc.row_logsumexp(y)}


@cc.epilogue
def sigmoid_chain(acc, scale: cc.ColVec):
    """A gated sigmoid chain: sigmoid(acc) * silu(acc * scale) + gelu_tanh(acc)."""
    return cc.sigmoid(acc) * cc.silu(acc * scale) + cc.gelu_tanh(acc)


@cc.epilogue
def exp_log_chain(acc, rstd: cc.RowVec):
    """log(1 + exp(x)) (softplus) of the row-scaled accumulator, and exp(-x^2) beside it."""
    x = cc.clamp(acc * rstd, -20.0, 20.0)
    return {"D": cc.log(1.0 + cc.exp(x)), "E": cc.exp(-x * x)}


@cc.epilogue
def mish_like(acc):
    """x * tanh(softplus(x)): a tanh of a log of an exp per element."""
    x = cc.clamp(acc, -20.0, 20.0)
    return x * cc.tanh(cc.log(1.0 + cc.exp(x)))


@cc.epilogue
def geglu_tanh_sumsq(acc, residual: cc.Tile["N/2"]):
    """GELU (tanh form) gated pairs plus an N/2-wide residual, and the rows' sums of squares."""
    gate, up = cc.pairs(acc)
    h = cc.gelu_tanh(gate) * up + residual
    return {"D": h, "sumsq": cc.row_sumsq(h)}


TRANSCENDENTAL = (erf_gelu_gate, tanh_soft_cap, sigmoid_chain, exp_log_chain, mish_like, geglu_tanh_sumsq)


def programs(kinds) -> list[tuple[str, cc.Program]]:
    """(kind, program) for each kind asked for, in a fixed order."""
    out = []
    if "library" in kinds:
        out += [("library", library.get(name)) for name in sorted(library.programs())
                if not any(op.kind == "table" for op in library.get(name).operands)]
    if "random" in kinds:
        out += [("random", random_program(seed)) for seed in RANDOM_SEEDS]
    if "transcendental" in kinds:
        out += [("transcendental", p) for p in TRANSCENDENTAL]
    if "derived" in kinds:
        out += [("derived", cc.derive(library.get(name)).backward) for name in DERIVED_FROM]
    return out


def unfused(program: cc.Program):
    """The program's math as a PyTorch user runs it: the GEMM in the inputs' dtype (cuBLAS), then
    its epilogue as PyTorch ops in fp32 (the reference interpreter), outputs as the kernel stores them."""
    def run(a, b, operands):
        return evaluate_accumulator(program, (a @ b.t()).float(), operands).outputs
    # a code object per program: dynamo counts recompiles per code object and runs eager after 8
    run.__code__ = run.__code__.replace()
    return run


def _outputs(result, program) -> dict:
    return result if isinstance(result, dict) else {program.outputs[0].name: result}


def _relative_error(got: dict, want: dict) -> float:
    return max(((got[k].float() - want[k].float()).norm() / want[k].float().norm().clamp_min(1e-12)).item()
               for k in want)


def measure(kind: str, program: cc.Program, shape: str, args) -> dict:
    """One row: build and check the contenders for `program` at `shape`, then time them."""
    m, n, k = map(int, shape.split("x"))
    started, device = time.perf_counter(), "cpu" if args.smoke else "cuda"
    a, b, operands = random_call(program, m, n, k, torch.bfloat16, device=device)
    fused, tuned = cc.Kernel(program), cc.Kernel(program, autotune=not args.smoke)
    want = evaluate_accumulator(program, (a.float() @ b.float().t()), operands).outputs
    row = {"program": program.name, "kind": kind, "shape": shape}
    got = _outputs(fused(a, b, **operands), program)
    row["rel_err"] = _relative_error(got, want)
    if row["rel_err"] > 2e-2:
        raise AssertionError(f"{program.name} at {shape}: fused relative error {row['rel_err']:.3g}")
    tuned(a, b, **operands)
    row["config"] = short_config(fused.last.config) if fused.last.config else None
    row["autotune_config"] = short_config(tuned.last.config) if tuned.last.config else None
    plain = cc.Kernel(library.get("gemm")) if args.smoke else plain_gemm(fused.last.config)
    compiled = torch.compile(unfused(program), dynamic=False, **(dict(backend="aot_eager") if args.smoke else {}))
    compiled(a, b, operands)
    built = time.perf_counter()
    contenders = {"fused": lambda: fused(a, b, **operands), "fused autotune": lambda: tuned(a, b, **operands),
                  "GEMM": lambda: plain(a, b), "torch.compile": lambda: compiled(a, b, operands)}
    row.update(time_interleaved(contenders, args.reps, args.smoke))
    row["fused_over_gemm"] = row["fused"]["ms"] / row["GEMM"]["ms"]
    row["autotune_over_gemm"] = row["fused autotune"]["ms"] / row["GEMM"]["ms"]
    row["compile_over_fused"] = row["torch.compile"]["ms"] / min(row["fused"]["ms"], row["fused autotune"]["ms"])
    # where a row's time goes: loading and tuning kernels, torch.compile, checking; then timing
    row["seconds"] = {"build": round(built - started, 1), "timed": round(time.perf_counter() - built, 1)}
    return row


def plain_gemm(config) -> cc.Kernel:
    """Our plain GEMM at a fused kernel's tile, cluster and schedule: what its epilogue costs on top."""
    return cc.Kernel(library.get("gemm"), tile=config.tile, cluster=config.cluster, schedule=config.schedule)


def precompile_rows(work: list[tuple[str, cc.Program, str]], jobs: int) -> dict:
    """Build every kernel the rows of ``work`` (kind, program, shape) will load into the disk
    cache, ``jobs`` processes at a time: each program's default as a call decides it, the
    autotune candidates around it, and our plain GEMM at the rules' configuration.  What a row
    still compiles itself (a default that spilled and fell back) is left to it."""
    gemm, device = library.get("gemm"), "cuda" if torch.cuda.is_available() else "cpu"
    defaults, others = [], []
    for _, program, shape in work:
        m, n, k = map(int, shape.split("x"))
        a, b, operands = random_call(program, m, n, k, torch.bfloat16, device=device)
        try:
            config = cc.Kernel(program).config_for(bind(program, a, b, operands))
        except CodaError:
            continue  # its row says why
        defaults.append((program, config))
        others += [(program, c) for c in tune_candidates(config.resolved(program))[1:]]
        others.append((gemm, plain_gemm(config).config_for(bind(gemm, a, b, {}))))
    start = time.perf_counter()
    results = precompile_pairs(defaults, jobs=jobs, decide=True) + precompile_pairs(others, jobs=jobs)
    done = {"kernels": sum(r.ok for r in results), "seconds": round(time.perf_counter() - start, 1),
            "failed": [r.line() for r in results if r.status == "failed"]}
    print(f"precompiled {done['kernels']} kernels with {jobs} processes in {done['seconds']:.0f} s"
          + "".join(f"; failed: {line}" for line in done["failed"]), flush=True)
    return done


def print_row(row: dict):
    print(f"{row['kind']:14s} {row['program']:28s} {row['shape']:15s} "
          f"fused/GEMM {row['fused_over_gemm']:.3f}  autotune/GEMM {row['autotune_over_gemm']:.3f}  "
          f"torch.compile/fused {row['compile_over_fused']:.2f}  ({row['config']}; tuned: {row['autotune_config']}; "
          f"{row['seconds']['build']:.0f} + {row['seconds']['timed']:.0f} s)", flush=True)


def summary(rows: list[dict]) -> list[str]:
    """Per shape and kind: median and worst fused / GEMM (default and autotune), and the programs
    torch.compile beats."""
    lines = []
    for shape in dict.fromkeys(r["shape"] for r in rows):
        for kind in dict.fromkeys(r["kind"] for r in rows):
            sel = [r for r in rows if r["shape"] == shape and r["kind"] == kind]
            if not sel:
                continue
            default, tuned = [r["fused_over_gemm"] for r in sel], [r["autotune_over_gemm"] for r in sel]
            beaten = [r["program"] for r in sel if r["compile_over_fused"] < 1.0]
            lines.append(f"{shape} {kind} ({len(sel)}): fused/GEMM median {statistics.median(default):.3f} worst "
                         f"{max(default):.3f}; autotune median {statistics.median(tuned):.3f} worst {max(tuned):.3f}; "
                         f"torch.compile faster for: {', '.join(beaten) or 'none'}")
    return lines


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), help="MxNxK (A is M x K, B is N x K)")
    parser.add_argument("--reps", type=int, default=3, help="interleaved rounds per contender")
    parser.add_argument("--programs", nargs="+", metavar="NAME",
                        help="only the programs of these names (e.g. swiglu_bwd swiglu_backward: a hand-written "
                             "backward beside its derived one)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count(),
                        help="processes that build the kernels before the timed rows (default: one per CPU)")
    parser.add_argument("--out", default="programs.json")
    parser.add_argument("--smoke", action="store_true", help="CPU, a tiny shape, no autotune: the plumbing only")
    args = parser.parse_args(argv)
    unknown = set(args.programs or ()) - {program.name for _, program in programs(args.kinds)}
    if unknown:
        parser.error(f"--programs: no program of kinds {' '.join(args.kinds)} is named {', '.join(sorted(unknown))}")
    if args.smoke:
        args.shapes, args.reps = [SMOKE_SHAPE], 1
    return args


def main(argv=None):
    args = parse_args(argv)
    torch.manual_seed(0)
    rows, skipped = [], []
    work = [(kind, program, shape) for shape in args.shapes for kind, program in programs(args.kinds)
            if not args.programs or program.name in args.programs]
    built = None if args.smoke else precompile_rows(work, args.jobs)
    for kind, program, shape in work:
        try:
            rows.append(measure(kind, program, shape, args))
        except CodaError as exc:  # a program this shape or these inputs cannot run: said, not hidden
            skipped.append(f"{program.name} at {shape}: {type(exc).__name__}: {exc}")
            print(f"skipped {skipped[-1]}", flush=True)
            continue
        print_row(rows[-1])
        # after every program: a run cut short keeps what it measured
        write(args.out, rows, args.smoke, {"precompile": built} if built else None)
    print("\n".join(["", "== summary", *summary(rows), *(f"skipped: {s}" for s in skipped)]))


if __name__ == "__main__":
    main()

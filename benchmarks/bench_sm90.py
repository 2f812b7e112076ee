"""How fast is each fused op against our own plain GEMM on the same operands, cuBLAS, PyTorch
eager and torch.compile; and (`--variants`) which tile, cluster, schedule, tile order (swizzle,
raster) and shared-memory split is fastest for it?

    python benchmarks/bench_sm90.py [--d 4096] [--reps 5] [--out results.json]
        [--compile-modes default max-autotune-no-cudagraphs] [--ops SwiGLU ...] [--quack] [--variants]
        [--tree LABEL=DIR ...] [--vocab 128256]

Each op is timed with triton.testing.do_bench (median of ~100 ms of launches, L2 flushed
between launches) for every contender, interleaved, `--reps` times; the table gives the
median of the repetitions and their spread (max - min) / median.  A fused op's time
includes everything it needs (e.g. finishing reduction partials).  Inputs are random
normal (small-integer data runs faster).  The fused ops compute the same outputs as the
torch versions (checked before timing).

`--tree base=DIR` also times each op's kernel as another checkout of coda-cute emits it, for
the same configuration: an A/B of a lowering or template change in one process.  DIR holds
that checkout's `coda_cute`, `templates` and `epilogues`, e.g. for a commit REV:

    mkdir -p scratch/base && git archive REV coda_cute templates epilogues | tar -x -C scratch/base
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import platform
import statistics
import sys
import subprocess
import tempfile
import time

import torch
import torch.nn.functional as F

import coda_cute as cc
from coda_cute import library
from coda_cute.compile import compile_source
from coda_cute.config import DEFAULT_SWIZZLE
from coda_cute.render import emit_command

from bench_block import commit  # the commit a result file names

SHAPES = {  # hidden d -> (ffn, qkv)
    2048: (8192, 3072),
    4096: (14336, 6144),
    8192: (28672, 10240),
}


def rope_torch(y, cos, sin, rotary_cols):
    x0, x1 = y[:, 0::2].float(), y[:, 1::2].float()
    pairs = x0.shape[1]
    j = torch.arange(pairs, device=y.device)
    r = torch.arange(y.shape[0], device=y.device)
    c = cos[r[:, None] % cos.shape[0], j[None, :] % cos.shape[1]]
    s = sin[r[:, None] % sin.shape[0], j[None, :] % sin.shape[1]]
    rot = (j < rotary_cols // 2)[None, :]
    y0 = torch.where(rot, x0 * c - x1 * s, x0)
    y1 = torch.where(rot, x0 * s + x1 * c, x1)
    return torch.stack([y0, y1], -1).flatten(-2).to(y.dtype)


def swiglu_bwd_torch(dh, preact):
    g, u = preact[:, 0::2].float(), preact[:, 1::2].float()
    sig = torch.sigmoid(g)
    dg = dh.float() * u * sig * (1 + g * (1 - sig))
    du = dh.float() * g * sig
    return torch.stack([dg, du], -1).flatten(-2).to(dh.dtype)


def ops_for(d: int, m: int, rope_positions: int = 4096, vocab: int = 0):
    ffn, qkv = SHAPES[d]
    bf = torch.bfloat16
    dev = "cuda"

    def w(n, k):
        return torch.randn(n, k, device=dev, dtype=bf) * k ** -0.5

    x = torch.randn(m, d, device=dev, dtype=bf)
    h = torch.randn(m, ffn, device=dev, dtype=bf)
    ops = []
    # name, program, a, b, operands, torch function of (a, b, **operands) giving the same outputs
    ops.append(("GEMM QKV", library.get("gemm"), x, w(qkv, d), {}, lambda a, b: a @ b.t()))
    ops.append(("GEMM gate/up", library.get("gemm"), x, w(2 * ffn, d), {}, lambda a, b: a @ b.t()))
    ops.append(("GEMM down", library.get("gemm"), h, w(d, ffn), {}, lambda a, b: a @ b.t()))
    rstd = torch.rand(m, device=dev) + 0.5
    ops.append(("QKV GEMM + RMSNorm row scale", library.get("rms_scale"), x, w(qkv, d), {"rstd": rstd},
                lambda a, b, rstd: ((a @ b.t()).float() * rstd[:, None]).to(bf)))
    cos, sin = torch.randn(rope_positions, 64, device=dev), torch.randn(rope_positions, 64, device=dev)
    rotary = qkv - 2 * (qkv // 6)  # q and k heads; v passes through
    rope = library.get("rope_qkv").with_constants(rotary_cols=rotary)
    ops.append(("QKV GEMM + RoPE", rope, x, w(qkv, d), {"cos": cos, "sin": sin},
                lambda a, b, cos, sin: rope_torch(a @ b.t(), cos, sin, rotary)))
    # Hugging Face's Llama hands RoPE its tables in the activation dtype: half the table traffic
    ops.append(("QKV GEMM + RoPE (bf16 tables)", rope, x, w(qkv, d), {"cos": cos.to(bf), "sin": sin.to(bf)},
                lambda a, b, cos, sin: rope_torch(a @ b.t(), cos, sin, rotary)))
    resid = torch.randn(m, d, device=dev, dtype=bf)
    ops.append(("O GEMM + residual + sumsq", library.get("residual_sumsq"), x, w(d, d), {"residual": resid},
                lambda a, b, residual: _res_sumsq(a, b, residual)))
    ops.append(("gate/up GEMM + SwiGLU", library.get("swiglu"), x, w(2 * ffn, d), {},
                lambda a, b: _swiglu(a @ b.t())))
    ops.append(("gate/up GEMM + RMS + SwiGLU + save", library.get("rms_swiglu_save"), x, w(2 * ffn, d),
                {"rstd": rstd}, lambda a, b, rstd: _rms_swiglu_save(a @ b.t(), rstd)))
    dy = torch.randn(m, d, device=dev, dtype=bf)
    preact = torch.randn(m, 2 * ffn, device=dev, dtype=bf)
    w_down = w(d, ffn)
    ops.append(("down dgrad + SwiGLU bwd", library.get("swiglu_bwd"), dy, w_down.t(), {"preact": preact},
                lambda a, b, preact: swiglu_bwd_torch(a @ b.t(), preact)))
    gamma = torch.rand(d, device=dev, dtype=bf) + 0.5
    w_qkv = w(qkv, d)
    dz = torch.randn(m, qkv, device=dev, dtype=bf)
    ops.append(("down dgrad + SwiGLU bwd + h", library.get("swiglu_bwd_recompute"), dy, w_down.t(),
                {"preact": preact}, lambda a, b, preact: _swiglu_bwd_h(a @ b.t(), preact)))
    ops.append(("QKV dgrad + RMSNorm bwd stats", library.get("rmsnorm_bwd"), dz, w_qkv.t(),
                {"x": x, "rstd": rstd, "gamma": gamma},
                lambda a, b, x, rstd, gamma: _rms_bwd(a @ b.t(), x, rstd, gamma)))
    dz_gate_up, rowdot = torch.randn(m, 2 * ffn, device=dev, dtype=bf), torch.randn(m, device=dev)
    ops.append(("gate/up dgrad + RMSNorm bwd, all of dx", library.get("rmsnorm_bwd_rowdot"), dz_gate_up,
                w(2 * ffn, d).t(), {"x": x, "rstd": rstd, "gamma": gamma, "dresidual": dy, "rowdot": rowdot,
                                    "inv_n": 1.0 / d}, _rms_bwd_rowdot))
    if vocab:  # the LM head's forward: the logits stored, their log-sum-exp and target logit per row
        target = torch.randint(0, vocab, (m,), device=dev, dtype=torch.int32)
        ops.append(("LM head GEMM + cross-entropy stats + logits", library.get("cross_entropy_stats_save"), x,
                    w(vocab, d), {"target": target}, _cross_entropy_stats_save))
    return ops


def _variants(program):
    """Other tile / cluster / schedule / stage choices, to pick the defaults from."""
    out = []
    tile_inputs = any(op.kind == "tile" for op in program.operands)
    if tile_inputs:  # inputs prefetched further ahead
        out.append(("128x256 c2x1 cooperative, 3 AB stages", cc.Kernel(program, tile=(128, 256), cluster=(2, 1),
                                                                       ab_stages=3)))
    for tile, cluster, schedule in (((128, 256), (1, 2), "cooperative"), ((128, 256), (2, 1), "cooperative"),
                                    ((256, 128), (2, 1), "cooperative"), ((256, 128), (1, 2), "cooperative"),
                                    ((64, 256), (2, 1), "pingpong"),
                                    ((64, 256), (1, 2), "pingpong"), ((128, 128), (2, 1), "cooperative"),
                                    ((128, 128), (1, 2), "pingpong"), ((128, 128), (2, 1), "pingpong"),
                                    ((128, 192), (1, 2), "pingpong"), ((128, 192), (2, 1), "pingpong")):
        label = f"{tile[0]}x{tile[1]} c{cluster[0]}x{cluster[1]} {schedule}"
        out.append((label, cc.Kernel(program, tile=tile, cluster=cluster, schedule=schedule)))
    for swizzle in (s for s in (1, 2, 4, 8) if s != DEFAULT_SWIZZLE):  # the default tile in another tile order
        out.append((f"default tile, swizzle {swizzle}", cc.Kernel(program, swizzle=swizzle)))
    out.append(("default tile, raster along N", cc.Kernel(program, raster_along_m=False)))
    # the default tile with its shared memory split otherwise: stores in flight vs mainloop stages
    out.append(("default tile, output rings 2 deep", cc.Kernel(program, epi_stages=2)))
    out.append(("default tile, 3 AB stages, output rings 4 deep", cc.Kernel(program, ab_stages=3, epi_stages=4)))
    if tile_inputs:  # the whole tile's inputs loaded during the mainloop
        out.append(("default tile, 3 AB stages, input rings a tile deep", cc.Kernel(program, ab_stages=3)))
    if any(op.kind == "table" for op in program.operands):  # tables gathered from global memory (the default
        out.append(("default tile, tables gathered", cc.Kernel(program, stage_tables=False)))  # stages them)
    return out


def tree_contender(tree, kernel, a, b, operands):
    """The call of `kernel` (its plan for these operands) with the kernel that the checkout in
    `tree` emits for the same program and configuration; None (said why) where it cannot."""
    program = kernel.program
    if program.fingerprint != library.get(program.name).fingerprint:
        print(f"{program.name}: not the library's program (constants set), so {tree} cannot emit it", flush=True)
        return None
    plan, _ = kernel.plan(a, b, operands, None)
    command = shlex.split(emit_command(program, plan.config))[1:]  # emit NAME --flags...
    path_first = os.pathsep.join([os.path.abspath(tree), os.environ.get("PYTHONPATH", "")])  # its coda_cute
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, f"{program.name}.py")
        done = subprocess.run([sys.executable, "-m", "coda_cute.cli", *command, "-o", path], cwd=tree,
                              env=dict(os.environ, PYTHONPATH=path_first), capture_output=True, text=True)
        if done.returncode != 0:
            print(f"{program.name}: {tree} did not emit it: {done.stderr.strip()[-300:]}", flush=True)
            return None
        source = open(path).read()
    other = dataclasses.replace(plan, function=compile_source(source, program, plan.config, tvm_ffi=True).function)
    return lambda: other.run(a, b, operands, None, False)


def _swiglu_bwd_h(dh, preact):
    dz = swiglu_bwd_torch(dh, preact)
    return {"D": dz, "h": _swiglu(preact), "rowdot": (dz.float() * preact.float()).sum(-1)}


def quack_contender(name, a, b, operands):
    """The same op through quack (Dao-AILab's CuTe-DSL kernels), where it has one; else None.

    quack's gated kernels use the same interleaved (gate, up) column order as ours; B is (K, N)."""
    from quack.gemm_interface import gemm, gemm_dgated, gemm_gated

    if name.startswith("GEMM "):
        return lambda: gemm(a, b.t(), tuned=False)
    if name == "gate/up GEMM + SwiGLU":
        return lambda: gemm_gated(a, b.t(), activation="swiglu", store_preact=False, tuned=False)[1]
    if name == "down dgrad + SwiGLU bwd + h":
        def run():
            dx, h = gemm_dgated(a, b.t(), operands["preact"], activation="swiglu", tuned=False)
            return {"D": dx, "h": h}
        return run
    return None


def _res_sumsq(a, b, residual):
    hh = a @ b.t() + residual
    return {"D": hh, "sumsq": hh.float().pow(2).sum(-1)}


def _rms_swiglu_save(y, rstd):
    z = (y.float() * rstd[:, None]).to(y.dtype)
    return {"D": _swiglu(z), "preact": z}


def _cross_entropy_stats_save(a, b, target):
    logits = a @ b.t()
    return {"logits": logits, "lse": torch.logsumexp(logits.float(), -1),
            "target_logit": logits.float().gather(1, target.long()[:, None])[:, 0]}


def _swiglu(y):
    return (F.silu(y[:, 0::2].float()) * y[:, 1::2].float()).to(y.dtype)


def _rms_bwd(dy, x, rstd, gamma):
    dyf = dy.float()
    x_hat = x.float() * rstd[:, None]
    dx_hat = dyf * gamma.float()
    return {"D": (dx_hat * rstd[:, None]).to(dy.dtype), "rowdot": (dx_hat * x_hat).sum(-1),
            "dgamma": (dyf * x_hat).sum(0)}


def _rms_bwd_rowdot(a, b, x, rstd, gamma, dresidual, rowdot, inv_n):
    dy = (a @ b.t()).float()
    x_hat = x.float() * rstd[:, None]
    dx = (dy * gamma.float() - x_hat * (rowdot * inv_n)[:, None]) * rstd[:, None] + dresidual.float()
    return {"D": dx.to(a.dtype), "dgamma": (dy * x_hat).sum(0)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--d", type=int, nargs="+", default=[4096])
    parser.add_argument("--m", type=int, default=8192)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--compile-modes", nargs="*", default=["default"])
    parser.add_argument("--out", default="bench.json")
    parser.add_argument("--variants", nargs="*", metavar="LABEL",
                        help="also time other tile/cluster/schedule/stage choices (those whose label contains one "
                             "of the given strings; none given: all)")
    parser.add_argument("--ops", nargs="*", help="only the ops whose name contains one of these strings")
    parser.add_argument("--tree", nargs="*", default=[], metavar="LABEL=DIR",
                        help="also time the kernels another checkout of coda-cute (its coda_cute, templates and "
                             "epilogues in DIR) emits for the same configurations")
    parser.add_argument("--quack", action="store_true", help="also time quack's kernel for the ops it has (untuned)")
    parser.add_argument("--rope-positions", type=int, default=4096,
                        help="rows (positions) of the RoPE ops' cos/sin tables; 1 is a diagnostic: every row reads "
                             "the same 64 values, so the epilogue's table loads hit L1 and move no L2 traffic")
    parser.add_argument("--vocab", type=int, default=0,
                        help="also time the LM head's forward GEMM (cross_entropy_stats_save) at this vocabulary, "
                             "e.g. 128256 (0: not)")
    args = parser.parse_args()
    from triton.testing import do_bench

    torch.backends.cuda.matmul.allow_tf32 = False
    rows = []
    for d in args.d:
        for name, program, a, b, operands, fn in ops_for(d, args.m, args.rope_positions, args.vocab):
            if args.ops and not any(o in name for o in args.ops):
                continue
            kernel = cc.Kernel(program)
            t0 = time.perf_counter()
            ours = kernel(a, b, **operands)
            torch.cuda.synchronize()
            cold = time.perf_counter() - t0
            want = fn(a, b, **operands)
            _check(name, ours, want)
            gemm_only = lambda: a @ b.t()  # noqa: E731
            contenders = {"coda-cute": lambda: kernel(a, b, **operands), "cuBLAS GEMM alone": gemm_only,
                          "torch eager": lambda: fn(a, b, **operands)}
            if program.name != "gemm":  # the floor of a fused kernel: our own GEMM of the same operands
                plain = cc.Kernel(library.get("gemm"))
                contenders["coda-cute GEMM alone"] = lambda: plain(a, b)
            if args.quack:
                try:  # a contender that fails or computes something else is reported, not timed
                    quack_fn = quack_contender(name, a, b, operands)
                    if quack_fn is not None:
                        _check(f"{name} (quack)", quack_fn(), want)
                        contenders["quack (untuned)"] = quack_fn
                except Exception as exc:
                    print(f"{name}: quack not timed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            for label, tree in (t.split("=", 1) for t in args.tree):
                other = tree_contender(tree, kernel, a, b, operands)
                if other is not None:
                    _check(f"{name} ({label})", other(), want)
                    contenders[f"coda-cute {label}"] = other
            for label, variant in _variants(program) if args.variants is not None else ():
                if args.variants and not any(v in label for v in args.variants):
                    continue
                try:  # a choice that does not fit this program is reported, not timed
                    got = variant(a, b, **operands)
                except cc.UnsupportedError as exc:
                    print(f"{name}: {label} not timed: {exc}", flush=True)
                    continue
                try:  # nor is one that computes something else
                    _check(f"{name} ({label})", got, want)
                except AssertionError as exc:
                    print(f"{name}: {label} NOT timed, wrong result: {exc}", flush=True)
                    continue
                contenders[f"coda-cute {label}"] = lambda k=variant: k(a, b, **operands)
            for mode in args.compile_modes:
                compiled = torch.compile(fn, dynamic=False, mode=None if mode == "default" else mode)
                compiled(a, b, **operands)
                contenders[f"torch.compile {mode}"] = lambda c=compiled: c(a, b, **operands)
            times = {k: [] for k in contenders}
            for _ in range(args.reps):
                for key, f in contenders.items():
                    times[key].append(do_bench(f, warmup=25, rep=100))
            row = {"d": d, "op": name, "M": args.m, "N": b.shape[0], "K": a.shape[1], "config": kernel.last.config.describe(),
                   "first_call_s": round(cold, 2), "cuBLAS kernel": _kernel_names(gemm_only)}
            for key, ts in times.items():
                med = statistics.median(ts)
                row[key] = {"ms": med, "spread": (max(ts) - min(ts)) / med}
            rows.append(row)
            print(_line(row, contenders), f"\n    cuBLAS ran {', '.join(row['cuBLAS kernel'])}", flush=True)
            _write(args, rows)  # after every op: a run cut short keeps what it measured


def _write(args, rows):
    meta = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "cutlass_dsl": __import__("cutlass").__version__, "python": platform.python_version(),
            "commit": commit(), "command": "python " + " ".join(map(shlex.quote, sys.argv))}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


def _kernel_names(f):
    """The GPU kernels one call of `f` launches (which tile and cluster cuBLAS picked is in its name)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        f()
        torch.cuda.synchronize()
    return sorted({e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA})


def _check(name, ours, want):
    if isinstance(want, dict):
        for k, v in want.items():
            _check(f"{name}:{k}", ours[k], v)
        return
    err = (ours.float() - want.float()).norm() / want.float().norm()
    assert err < 2e-2, f"{name}: coda-cute differs from torch (relative error {err:.3g})"


def _line(row, contenders):
    parts = [f"{row['op']:32s} N={row['N']:6d} K={row['K']:6d}"]
    for key in contenders:
        parts.append(f"{key}: {row[key]['ms']:.3f} ms ±{100 * row[key]['spread']:.1f}%")
    return " | ".join(parts)


if __name__ == "__main__":
    main()

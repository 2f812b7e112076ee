"""Benchmark: the Llama MLP half, the whole block and the LM head + loss, forward + backward,
fused vs PyTorch.

    python benchmarks/bench_block.py [--d 4096] [--tokens 8192] [--reps 5] [--vocab 128256] [--out block.json]
                                     [--profile]

Contenders, interleaved in one process: coda-cute's LlamaMLP / LlamaBlock /
linear_cross_entropy (logits saved for backward, and recomputed with save_logits=False); the same math in
plain PyTorch (eager) and under torch.compile (dynamic=False); cuBLAS GEMMs alone (the
floor: the block's forward and backward GEMMs with nothing else).  Times include every
kernel a step needs (gamma refold, statistics, finishing partials, elementwise passes).
Attention itself (SDPA) is the same in every contender.  Before timing, each case checks
that coda-cute's output and input gradient match eager PyTorch's (relative norm < 2e-2).
"""

import argparse
import json
import os
import shlex
import statistics
import sys
import time

import torch

from coda_cute.nn import (
    LlamaBlock, LlamaMLP, linear_cross_entropy, llama_attention_reference, llama_mlp_reference, split_gate_up,
)

SHAPES = {2048: (8192, 16, 8), 4096: (14336, 32, 8), 8192: (28672, 64, 8)}  # d -> (ffn, heads, kv heads)


def _step(fn, h, grad):
    out = fn(h)
    out = out[0] if isinstance(out, tuple) else out
    out.backward(grad)
    return out


def _loss_step(fn, h):
    loss = fn(h)
    loss.backward()
    return loss


def _check(name, ours, reference, h):
    """The fused step computes what the eager one does: output and input gradient, relative norm."""
    results = []
    for step in (ours, reference):
        h.grad = None
        out = step()
        results.append((out.detach().float(), h.grad.float()))
    h.grad = None
    for what, got, want in zip(("output", "input gradient"), *results):
        err = ((got - want).norm() / want.norm()).item()
        assert err < 2e-2, f"{name}: coda-cute's {what} differs from eager PyTorch (relative error {err:.3g})"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--d", type=int, nargs="+", default=[4096])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--vocab", type=int, default=128256, help="LM head + cross-entropy case (0: skip it)")
    parser.add_argument("--out", default="block.json")
    parser.add_argument("--compile-modes", nargs="+", default=["default"],
                        help="torch.compile modes to time (default, max-autotune-no-cudagraphs)")
    parser.add_argument("--cases", nargs="+", choices=["MLP", "block", "LM"],
                        help="only these cases (LM: the LM head + cross-entropy; default: all)")
    parser.add_argument("--profile", action="store_true",
                        help="also print each contender's kernels (torch.profiler, one step, by GPU time)")
    args = parser.parse_args()
    from triton.testing import do_bench

    rows = []
    for d in args.d:
        ffn, heads, kv = SHAPES[d]
        batch = args.tokens // args.seq
        h = torch.randn(batch, args.seq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn_like(h)
        mlp = LlamaMLP(d, ffn, device="cuda")
        block = LlamaBlock(d, heads, ffn, n_kv_heads=kv, device="cuda", max_positions=args.seq)
        gate, up = split_gate_up(mlp.w_gate_up.detach())
        mlp_params = [p.clone().requires_grad_() for p in (mlp.gamma.detach(), gate, up, mlp.w_down.detach())]

        def mlp_eager(x):
            return llama_mlp_reference(x, *mlp_params, mlp.eps)

        hf = {k: v.clone().requires_grad_() for k, v in block.hf_weights().items()}
        att = block.attention

        def block_eager(x):
            x = llama_attention_reference(x, hf["input_layernorm.weight"], hf["self_attn.q_proj.weight"],
                                          hf["self_attn.k_proj.weight"], hf["self_attn.v_proj.weight"],
                                          hf["self_attn.o_proj.weight"], heads, kv, att.head_dim, att.cos, att.sin,
                                          att.eps)
            return llama_mlp_reference(x, hf["post_attention_layernorm.weight"], hf["mlp.gate_proj.weight"],
                                       hf["mlp.up_proj.weight"], hf["mlp.down_proj.weight"], block.mlp.eps)

        x2 = h.detach().reshape(-1, d)
        w_gu, w_dn = mlp.w_gate_up.detach(), mlp.w_down.detach()
        a_act = torch.randn(x2.shape[0], ffn, device="cuda", dtype=torch.bfloat16)
        dz = torch.randn(x2.shape[0], 2 * ffn, device="cuda", dtype=torch.bfloat16)

        def mlp_gemms():  # forward 2, backward 4 GEMMs of the MLP, nothing else
            x2 @ w_gu.t(); a_act @ w_dn.t(); x2 @ w_dn; x2.t() @ a_act; dz @ w_gu; dz.t() @ x2  # noqa: E702

        def compiled(fn, step):  # one contender per torch.compile mode
            return {_mode_label(mode): (lambda c=torch.compile(fn, dynamic=False, mode=_mode(mode)): step(c, h))
                    for mode in args.compile_modes}

        cases = {
            "MLP": {"coda-cute": lambda: _step(mlp, h, grad), "torch eager": lambda: _step(mlp_eager, h, grad),
                    **compiled(mlp_eager, lambda c, x: _step(c, x, grad)), "cuBLAS GEMMs alone": mlp_gemms},
            "block": {"coda-cute": lambda: _step(block, h, grad), "torch eager": lambda: _step(block_eager, h, grad),
                      **compiled(block_eager, lambda c, x: _step(c, x, grad))},
        }
        if args.vocab and (not args.cases or "LM" in args.cases):  # a 1-4 GB weight: only when timed
            w_head = (torch.randn(args.vocab, d, device="cuda") * d ** -0.5).bfloat16().requires_grad_()
            target = torch.randint(0, args.vocab, (batch, args.seq), device="cuda")

            def head_eager(x):
                return torch.nn.functional.cross_entropy((x @ w_head.t()).float().flatten(0, 1), target.flatten())

            def head_gemms():  # logits, dh and dW: three GEMMs of the head, nothing else
                logits = x2 @ w_head.t()
                logits @ w_head  # noqa: B018
                logits.t() @ x2  # noqa: B018

            cases["LM head + cross-entropy"] = {
                "coda-cute": lambda: _loss_step(lambda x: linear_cross_entropy(x, w_head, target), h),
                "coda-cute, recomputed logits": lambda: _loss_step(
                    lambda x: linear_cross_entropy(x, w_head, target, save_logits=False), h),
                "torch eager": lambda: _loss_step(head_eager, h),
                **compiled(head_eager, _loss_step),
                "cuBLAS GEMMs alone": head_gemms,
            }
        for name, contenders in cases.items():
            if args.cases and not any(name.startswith(c) for c in args.cases):
                continue
            for ours in (k for k in contenders if k.startswith("coda-cute")):
                _check(f"{name} ({ours})", contenders[ours], contenders["torch eager"], h)
            for f in contenders.values():
                f()  # compile / warm up
            times = {k: [] for k in contenders}
            for _ in range(args.reps):
                for key, f in contenders.items():
                    times[key].append(do_bench(f, warmup=5, rep=50))
            row = {"d": d, "what": f"{name} forward+backward", "tokens": args.tokens}
            row.update({k: {"ms": statistics.median(v), "spread": (max(v) - min(v)) / statistics.median(v)}
                        for k, v in times.items()})
            rows.append(row)
            print(row["what"], f"d={d}", " | ".join(f"{k}: {v['ms']:.3f} ms" for k, v in row.items()
                                                        if isinstance(v, dict)), flush=True)
            _write(args, rows)  # after every case: a run cut short keeps what it measured
            if args.profile:
                for key, f in contenders.items():
                    _profile(f"{name} / {key}, d={d}", f)


def _mode(mode):
    return None if mode == "default" else mode


def _mode_label(mode):
    """'torch.compile' for the default mode (the name earlier result files use), else with the mode."""
    return "torch.compile" if mode == "default" else f"torch.compile {mode}"


def _profile(title, f):
    """Where a step's GPU time goes: its kernels, summed by name, longest first."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        f()
        torch.cuda.synchronize()
    print(f"--- {title}", flush=True)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=90), flush=True)


def _write(args, rows):
    meta = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "commit": os.environ.get("CODA_COMMIT", "unknown"), "command": "python " + " ".join(map(shlex.quote, sys.argv))}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

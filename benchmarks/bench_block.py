"""Does coda-cute make a Llama training step cheaper than torch.compile, and how close does it get
to the floor (the step's GEMMs and attention alone)?  Forward + backward of three cases, 8192 tokens:

    MLP    RMSNorm + SwiGLU MLP + residual          (coda-cute: LlamaMLP)
    block  the whole Llama decoder block            (coda-cute: LlamaBlock)
    LM     LM head + cross-entropy, vocab 128256    (coda-cute: linear_cross_entropy, default and lean)

    python benchmarks/bench_block.py --d 4096 --out block.json
    python benchmarks/bench_block.py --d 8192 --cases MLP --reps 3 --out mlp.json   # one 10-minute call per d
    python benchmarks/bench_block.py --smoke --out /tmp/smoke.json                  # CPU: the plumbing only

Contenders, in one process, timed interleaved: coda-cute; torch.compile (default and
max-autotune-no-cudagraphs, `--compile-modes`); eager PyTorch; Liger-Kernel where it has the pieces
(LigerRMSNorm, LigerSiLUMulFunction, liger_rotary_pos_emb, LigerFusedLinearCrossEntropyLoss; skipped
with one line when `liger_kernel` does not import); the floor (the case's GEMMs, plus SDPA forward and
backward for the block, on ready-made operands: nothing else).  Before timing, coda-cute and Liger are
checked against eager PyTorch (output and input gradient, relative norm < 2e-2).

Per contender (JSON row per case and d; see `measure_case`): wall time (`triton.testing.do_bench`,
the median step of 300 ms after 150 ms of steps to settle the clock, median over --reps interleaved
rounds, each starting one contender later; spread = (max - min) / median); GPU time (torch.profiler:
the sum of the kernels of one step, after 150 ms of steps) split by `kernel_kind` into GEMM /
attention / coda-cute finish / other, every "other" and "finish" kernel listed with its time;
back-to-back time (`back_to_back`: steps queued one after the other for 300 ms after 150 ms of
steps, between two CUDA events, no L2 flush: the GPU's throughput at the clock sustained steps
hold: at the LM head (d = 4096) one profiled step's kernel sum moved by 2 ms between rounds where
this moved by 0.3, `results/README.md`); peak
memory of one step above what was allocated before it (weights excluded, their gradients
included).  Every step starts with the
gradients set to None (as after `optimizer.zero_grad()`), for timing, profiling and memory alike.
Per case, the bar: floor + (best torch.compile - floor) / 3, for wall, GPU and back-to-back time,
whether each coda-cute contender is under it, and its peak memory over the best torch.compile's.

The JSON: {"meta": {date, gpu, torch, commit, command}, "rows": [...]}, a row per (case, d):
    {"d", "case", "what", "tokens", "floor_runs" (what the floor runs), LM only: "vocab", "lean_kwargs",
     "gradient_gib" (h's and the weight's gradients, part of every contender's peak),
     <contender>: {"ms", "spread", "b2b_ms", "gpu_ms", "gemm_ms", "attention_ms", "finish_ms", "other_ms", "peak_gib",
                   "peak_live": [[GiB, where], ...] (allocated in the step, live at its peak; `peak_live`),
                   "gemm_kernels", "other_kernels", "finish_kernels": [[name, ms], ...] each,
                   checked ones: "rel_err": [output, input gradient]},
     "bar": {"best_compile": {metric: contender}, "wall_bar_ms", "gpu_bar_ms", "b2b_bar_ms",
             <coda-cute contender>: {"under_wall", "under_gpu", "under_b2b", "peak_ratio"}},
     "warm_up_s": {contender: s}, "dropped": {contender: why}}
(contenders: coda-cute, coda-cute derived (MLP: the same math as two programs of the user's kind,
trained with derived backwards through nn.EpilogueChain, the norm's glue torch.compiled), coda-cute lean (LM), torch eager,
torch.compile, torch.compile max-autotune-no-cudagraphs, Liger, floor; in --smoke only ms and
spread are measured, the rest null).

`--smoke` runs every contender on the CPU (bf16, d = 64, 64 tokens; coda-cute through its reference
interpreter, torch.compile through the aot_eager backend, no Liger): no do_bench, profiler or memory
statistics, only one perf_counter time per call, to prove the plumbing (tests/test_bench_block.py).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn
from torch.nn.functional import cross_entropy, scaled_dot_product_attention

# this checkout's coda_cute (the commit the result file names), not another installed one
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import coda_cute as cc  # noqa: E402
from coda_cute import library  # noqa: E402
from coda_cute.nn import (  # noqa: E402
    EpilogueChain, LlamaBlock, LlamaMLP, linear_cross_entropy, llama_attention_reference, llama_mlp_reference,
    split_gate_up,
)

# keyword arguments of the lean LM-head contender (never holds the tokens x vocab logits; its
# token chunk is nn.lean_token_chunk's default unless token_chunk is named here)
LEAN_KWARGS = dict(save_logits=False)
SHAPES = {2048: (8192, 16, 8), 4096: (14336, 32, 8), 8192: (28672, 64, 8)}  # d -> (ffn, heads, kv heads)
SMOKE = dict(d=64, shape=(128, 4, 2), tokens=64, seq=32, vocab=256)
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")
CASES = {"MLP": "MLP forward+backward", "block": "block forward+backward", "LM": "LM head + cross-entropy"}
TOLERANCE = 2e-2
EAGER, FLOOR, CODA = "torch eager", "floor", "coda-cute"

# ----------------------------------------------------------------------------------- kernel names
ATTENTION_MARKERS = ("flash", "fmha", "sdpa", "attention", "cudnn")
GEMM_MARKERS = ("gemm", "gemv", "nvjet", "cublas", "cutlass", "sm90_xmma", "splitkreduce")
CODA_MODULE = "coda_cute_kernel"  # coda_cute.compile.import_source names emitted modules coda_cute_kernel_<hash>


def kernel_kind(name: str) -> str:
    """What a GPU kernel of a step is, from its profiler name: 'gemm', 'finish', 'attention' or 'other'.

    Rules, first match wins (case-insensitive):
    1. coda-cute's kernels.  CuTe DSL names a kernel `kernel_cutlass_<method>_<module><Class>_object_at_...`
       (its mangler drops the dots of `str(self)`); coda-cute's module is `coda_cute_kernel_<hash>`, its
       class `<ProgramName>Kernel` (lower._class_name), e.g. `kernel_cutlass_kernel_coda_cute_kernel_
       4fcc6e61217bfa89RmsSwigluSaveKernel_object_at__...`.  Method `kernel`, the GEMM + epilogue, is
       'gemm'; method `finish` (a reduction's per-tile partials combined, templates/finish_kernel.py.j2) is
       'finish', kept apart so that its time stays visible.
    2. Triton kernels of torch.compile: `triton_tem_*` (Inductor's matmul templates) are 'gemm'; the
       other `triton_*` are 'other', even when named after an attention op (stride copies for SDPA).
    3. Other CuTe DSL kernels (`kernel_cutlass_*`, e.g. Liger's) are 'other': named after their class.
    4. Attention: flash, fmha, sdpa, attention, cudnn (SDPA's cuDNN backend and its helper kernels).
    5. GEMMs: cuBLAS (nvjet, cublas, sm90_xmma, gemm, gemv, splitKreduce) and CUTLASS.
    6. Anything else is 'other': elementwise, reductions, copies, memset / memcpy, Liger's Triton kernels.
    """
    n = name.lower()
    head, coda, _ = n.partition(CODA_MODULE)
    if coda:
        return "finish" if "finish" in head else "gemm"
    if n.startswith("triton_"):
        return "gemm" if n.startswith("triton_tem_") else "other"
    if n.startswith("kernel_cutlass_"):
        return "other"
    if any(m in n for m in ATTENTION_MARKERS):
        return "attention"
    return "gemm" if any(m in n for m in GEMM_MARKERS) else "other"


def short_name(name: str) -> str:
    """coda-cute's kernels as `coda-cute <Class>` / `coda-cute <Class>.finish`; others as they are."""
    found = re.search(CODA_MODULE + r"_[0-9a-f]*([A-Z]\w*?Kernel)_object", name)
    if found:
        return f"coda-cute {found.group(1)}" + (".finish" if kernel_kind(name) == "finish" else "")
    return name


def summarize(kernels: list[tuple[str, float]]) -> dict:
    """One step's kernels (name, ms, in launch order) -> GPU time in total and per kind, and the
    'gemm', 'other' and 'finish' kernels one by one (the GEMMs: to compare each with the floor's)."""
    total = {"gemm": 0.0, "attention": 0.0, "finish": 0.0, "other": 0.0}
    listed = {"gemm": [], "finish": [], "other": []}
    for name, ms in kernels:
        kind = kernel_kind(name)
        total[kind] += ms
        if kind in listed:
            listed[kind].append([short_name(name), round(ms, 4)])
    return {"gpu_ms": sum(total.values()), **{f"{k}_ms": v for k, v in total.items()},
            "gemm_kernels": listed["gemm"], "other_kernels": listed["other"], "finish_kernels": listed["finish"]}


# ----------------------------------------------------------------------------------- contenders
@dataclass
class Contender:
    """One way to run the case's training step.  `step()` runs forward + backward and returns the
    output; every tensor in `grads` has its gradient set to None first, so each call is a fresh step
    (as after optimizer.zero_grad()) and time and memory are measured alike for every contender."""
    step: Callable[[], torch.Tensor]
    grads: tuple = ()
    check: bool = False  # compared with eager PyTorch before timing

    def clear(self):
        for t in self.grads:
            t.grad = None

    def __call__(self):
        self.clear()
        return self.step()


@dataclass
class Case:
    contenders: dict[str, Contender]
    floor: str  # what the floor runs
    notes: dict = field(default_factory=dict)


class Bench:
    """What every case shares: the device, the input h and its incoming gradient, torch.compile, Liger."""

    def __init__(self, args):
        self.args, self.smoke = args, args.smoke
        self.device = "cpu" if args.smoke else "cuda"
        self.dtype = torch.bfloat16
        self.batch, self.seq = args.tokens // args.seq, args.seq
        self.liger = _import_liger(self.smoke)

    def shape(self, d):
        return SMOKE["shape"] if self.smoke else SHAPES[d]

    def tensor(self, *shape, scale=1.0, grad=False):
        t = torch.randn(*shape, device=self.device, dtype=self.dtype)
        return (t.mul_(scale) if scale != 1.0 else t).requires_grad_(grad)

    def inputs(self, d):
        self.h = self.tensor(self.batch, self.seq, d, grad=True)
        self.dh_out = self.tensor(self.batch, self.seq, d)

    def fwd_bwd(self, fn, params, check=False):
        """A contender that runs fn(h) and back-propagates the fixed incoming gradient."""
        h, dh_out = self.h, self.dh_out

        def step():
            out = fn(h)
            out = out[0] if isinstance(out, tuple) else out
            out.backward(dh_out)
            return out
        return Contender(step, (h, *params), check)

    def loss_bwd(self, fn, params, check=False):
        """A contender whose fn(h) is a scalar loss."""
        h = self.h

        def step():
            loss = fn(h)
            loss.backward()
            return loss
        return Contender(step, (h, *params), check)

    def compiled(self, fn, params, kind):
        """torch.compile of the eager function, one contender per mode (smoke: the aot_eager backend,
        which traces forward and backward as Inductor would, without generating code)."""
        out = {}
        for mode in self.args.compile_modes:
            how = dict(backend="aot_eager") if self.smoke else dict(mode=None if mode == "default" else mode)
            out[_mode_label(mode)] = kind(torch.compile(fn, dynamic=False, **how), params)
        return out


def _mode_label(mode):
    """'torch.compile' for the default mode (the name earlier result files use), else with the mode."""
    return "torch.compile" if mode == "default" else f"torch.compile {mode}"


def _import_liger(smoke):
    if smoke:
        print("Liger-Kernel: skipped (Triton kernels, no GPU in --smoke)")
        return None
    try:
        from liger_kernel.ops import LigerSiLUMulFunction
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss, LigerRMSNorm, liger_rotary_pos_emb
    except Exception as exc:  # noqa: BLE001 - any import failure means no Liger contender
        print(f"Liger-Kernel: skipped ({type(exc).__name__}: {exc})")
        return None
    import liger_kernel
    print(f"Liger-Kernel {getattr(liger_kernel, '__version__', '')}: imported")
    return dict(rms_norm=LigerRMSNorm, rope=liger_rotary_pos_emb, flce=LigerFusedLinearCrossEntropyLoss,
                silu_mul=lambda a, b: LigerSiLUMulFunction.apply(a, b, 1.0, 1.0))  # as LigerSwiGLUMLP calls it


def _parameters(*tensors):
    """Own copies as leaf parameters (the eager / compile / Liger contenders' weights, HF layout)."""
    return [nn.Parameter(t.detach().clone()) for t in tensors]


def _liger_norm(liger, gamma, eps):
    norm = liger["rms_norm"](gamma.shape[0], eps=eps)
    norm.weight = gamma  # shares the eager contenders' parameter
    return norm


def _liger_mlp(liger, gamma, w_gate, w_up, w_down, eps):
    """HF LlamaMLP with its norm and residual, Liger's way: LigerRMSNorm, cuBLAS GEMMs, LigerSiLUMul."""
    norm = _liger_norm(liger, gamma, eps)

    def mlp(h):
        x = norm(h)
        return h + liger["silu_mul"](x @ w_gate.t(), x @ w_up.t()) @ w_down.t()
    return mlp


def _mlp_gemms(x, w_gate_up, w_down, dy, a, dz):
    """The MLP's GEMMs alone: forward gate/up and down, backward dgrad and wgrad of both."""
    def gemms():
        x @ w_gate_up.t(); a @ w_down.t()  # noqa: E702
        dy @ w_down; dy.t() @ a  # noqa: E702
        dz @ w_gate_up; return dz.t() @ x  # noqa: E702
    return gemms


@cc.epilogue
def rms_swiglu(acc, rstd: cc.RowVec):
    """SwiGLU over interleaved gate/up columns of the row-normalized GEMM (gamma is on the input)."""
    gate, up = cc.pairs(acc * rstd)
    return cc.silu(gate) * up


def _derived_mlp(mlp: LlamaMLP, smoke: bool):
    """The Llama MLP as a user would write it: two forward programs (rms_swiglu, then the library's
    residual_sumsq), their backwards derived (nn.EpilogueChain), the norm's statistics and gamma
    in PyTorch, compiled (torch.compile fuses that glue into one kernel each way; smoke: the
    aot_eager backend).  Shares `mlp`'s weights."""
    d, ffn = mlp.w_down.shape
    chain = EpilogueChain([rms_swiglu, library.get("residual_sumsq")], d, [2 * ffn, d], outputs=["D"],
                          device=mlp.w_down.device, dtype=mlp.w_down.dtype)  # sumsq: a statistic
    chain.weights[0], chain.weights[1] = mlp.w_gate_up, mlp.w_down

    def norm(x2, gamma):
        return torch.rsqrt(x2.float().square().mean(-1) + mlp.eps), x2 * gamma
    norm = torch.compile(norm, dynamic=False, **(dict(backend="aot_eager") if smoke else {}))

    def derived(x):
        x2 = x.reshape(-1, d)
        rstd, scaled = norm(x2, mlp.gamma)
        h, _sumsq = chain(scaled, [{"rstd": rstd}, {"residual": x2}])
        return h.reshape(x.shape)
    return derived


def mlp_case(b: Bench, d) -> Case:
    ffn, _, _ = b.shape(d)
    mlp = LlamaMLP(d, ffn, device=b.device, dtype=b.dtype)
    p = _parameters(mlp.gamma, *split_gate_up(mlp.w_gate_up), mlp.w_down)

    def eager(x):
        return llama_mlp_reference(x, *p, mlp.eps)

    tokens = b.batch * b.seq
    floor = _mlp_gemms(b.tensor(tokens, d), mlp.w_gate_up.detach(), mlp.w_down.detach(), b.tensor(tokens, d),
                       b.tensor(tokens, ffn), b.tensor(tokens, 2 * ffn))
    c = {CODA: b.fwd_bwd(mlp, mlp.parameters(), check=True),
         f"{CODA} derived": b.fwd_bwd(_derived_mlp(mlp, b.smoke), mlp.parameters(), check=True), EAGER: b.fwd_bwd(eager, p),
         **b.compiled(eager, p, b.fwd_bwd)}
    if b.liger:
        c["Liger"] = b.fwd_bwd(_liger_mlp(b.liger, *p, mlp.eps), p, check=True)
    c[FLOOR] = Contender(floor)
    return Case(c, "6 cuBLAS GEMMs (fused gate/up, down: forward, dgrad, wgrad)")


def block_case(b: Bench, d) -> Case:
    ffn, heads, kv = b.shape(d)
    block = LlamaBlock(d, heads, ffn, n_kv_heads=kv, device=b.device, dtype=b.dtype, max_positions=b.seq)
    att = block.attention
    names = ("input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
             "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    hf = block.hf_weights()
    w = dict(zip(names, _parameters(*(hf[f"{n}.weight"] for n in names))))
    attention = (heads, kv, att.head_dim, att.cos, att.sin, att.eps)
    mlp_weights = [w[n] for n in names[5:]]

    def eager(x):
        x = llama_attention_reference(x, *[w[n] for n in names[:5]], *attention)
        return llama_mlp_reference(x, *mlp_weights, block.mlp.eps)

    p = list(w.values())
    c = {CODA: b.fwd_bwd(block, block.parameters(), check=True), EAGER: b.fwd_bwd(eager, p),
         **b.compiled(eager, p, b.fwd_bwd)}
    if b.liger:
        c["Liger"] = b.fwd_bwd(_liger_block(b, w, names, attention, block.mlp.eps), p, check=True)
    c[FLOOR] = Contender(_block_floor(b, block, d, ffn))
    return Case(c, ("12 cuBLAS GEMMs (fused QKV, O, fused gate/up, down: forward, dgrad, wgrad) "
                   "+ SDPA forward and backward"))


def _liger_block(b: Bench, w, names, attention, mlp_eps):
    """HF LlamaDecoderLayer as Liger patches it: LigerRMSNorm, liger_rotary_pos_emb, SDPA, LigerSiLUMul."""
    heads, kv, hd, cos, sin, eps = attention
    cos2, sin2 = (torch.cat([t[:b.seq], t[:b.seq]], -1).to(b.dtype)[None] for t in (cos, sin))  # (1, seq, hd)
    norm = _liger_norm(b.liger, w[names[0]], eps)
    mlp = _liger_mlp(b.liger, *[w[n] for n in names[5:]], mlp_eps)

    def block(h):
        bsz, seq, _ = h.shape
        x = norm(h)
        q, k, v = ((x @ w[n].t()).view(bsz, seq, -1, hd).transpose(1, 2) for n in names[1:4])
        q, k = b.liger["rope"](q, k, cos2, sin2)
        o = scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=heads != kv)
        return mlp(h + o.transpose(1, 2).reshape(bsz, seq, -1) @ w[names[4]].t())
    return block


def _block_floor(b: Bench, block, d, ffn):
    """The block's GEMMs and attention alone: QKV and O forward / dgrad / wgrad, SDPA forward and
    backward on q, k, v laid out as LlamaAttention's (views of one qkv buffer), the MLP's GEMMs."""
    att, tokens = block.attention, b.batch * b.seq
    hd, nq, nkv = att.head_dim, att.n_heads, att.n_kv_heads
    w_qkv, w_o = att.w_qkv.detach(), att.w_o.detach()
    rows, o_cols = w_qkv.shape[0], w_o.shape[1]
    x, attn, dy, dqkv = b.tensor(tokens, d), b.tensor(tokens, o_cols), b.tensor(tokens, d), b.tensor(tokens, rows)
    qkv = b.tensor(b.batch, b.seq, rows)
    q, k, v = (t.reshape(b.batch, b.seq, -1, hd).transpose(1, 2).detach().requires_grad_()
               for t in qkv.split([nq * hd, nkv * hd, nkv * hd], -1))
    d_attn = b.tensor(b.batch, b.seq, nq, hd).transpose(1, 2)  # as the O projection's dgrad hands it back
    mlp = block.mlp
    mlp_gemms = _mlp_gemms(x, mlp.w_gate_up.detach(), mlp.w_down.detach(), dy, b.tensor(tokens, ffn),
                           b.tensor(tokens, 2 * ffn))

    def floor():
        x @ w_qkv.t()  # noqa: B018
        out = scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=nq != nkv)
        attn @ w_o.t(); dy @ w_o; dy.t() @ attn  # noqa: E702
        torch.autograd.grad(out, (q, k, v), d_attn)
        dqkv @ w_qkv; dqkv.t() @ x  # noqa: E702
        return mlp_gemms()
    return floor


def lm_case(b: Bench, d) -> Case:
    vocab, tokens = b.args.vocab, b.batch * b.seq
    w = b.tensor(vocab, d, scale=d ** -0.5, grad=True)
    target = torch.randint(0, vocab, (b.batch, b.seq), device=b.device)

    def eager(x):
        return cross_entropy((x @ w.t()).float().flatten(0, 1), target.flatten())

    x2 = b.tensor(tokens, d)

    def floor():  # logits, dh and dW: the head's three GEMMs
        logits = x2 @ w.detach().t()
        logits @ w.detach()  # noqa: B018
        return logits.t() @ x2

    c = {CODA: b.loss_bwd(lambda x: linear_cross_entropy(x, w, target), [w], check=True),
         f"{CODA} lean": b.loss_bwd(lambda x: linear_cross_entropy(x, w, target, **LEAN_KWARGS), [w], check=True),
         EAGER: b.loss_bwd(eager, [w]), **b.compiled(eager, [w], b.loss_bwd)}
    if b.liger:
        flce = b.liger["flce"]()
        c["Liger"] = b.loss_bwd(lambda x: flce(w, x.reshape(-1, d), target.flatten()), [w], check=True)
    c[FLOOR] = Contender(floor)
    lean = ", ".join(f"{k}={v!r}" for k, v in LEAN_KWARGS.items())
    gradients = (tokens + vocab) * d * w.element_size() / 2 ** 30  # h.grad and w.grad: what every contender makes
    return Case(c, "3 cuBLAS GEMMs (logits, dh, dW)", {"vocab": vocab, "lean_kwargs": lean, "gradient_gib": gradients})


BUILDERS = {"MLP": mlp_case, "block": block_case, "LM": lm_case}


# ----------------------------------------------------------------------------------- measurements
def _relative_error(got, want):
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def check(case: Case, h, dropped: dict) -> dict:
    """Output and input gradient of each checked contender against eager PyTorch's.  coda-cute's
    mismatch stops the run; Liger's drops it (printed, and named in the row)."""
    want = case.contenders[EAGER]().detach(), h.grad.detach().clone()
    errors = {}
    for name in [n for n, c in case.contenders.items() if c.check]:
        try:
            got = case.contenders[name]().detach(), h.grad
            errors[name] = [_relative_error(g, w) for g, w in zip(got, want)]
            bad = [what for what, e in zip(("output", "input gradient"), errors[name]) if not e < TOLERANCE]
            if bad:
                raise AssertionError(f"{name}'s {' and '.join(bad)} differ from eager PyTorch: "
                                     f"relative errors {errors[name][0]:.3g}, {errors[name][1]:.3g}")
        except Exception as exc:
            if name.startswith(CODA):
                raise
            _drop(case, name, exc, dropped)
    h.grad = None
    return errors


def _drop(case: Case, name, exc, dropped):
    reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
    print(f"  {name}: dropped ({reason})", flush=True)
    dropped[name] = reason
    case.contenders.pop(name)


def warm_up(case: Case, dropped: dict) -> dict:
    """One call each (torch.compile compiles here, coda-cute and Triton load or compile kernels): seconds."""
    seconds = {}
    for name in list(case.contenders):
        start = time.perf_counter()
        try:
            case.contenders[name]()
        except Exception as exc:
            if name.startswith(CODA) or name in (EAGER, FLOOR):
                raise
            _drop(case, name, exc, dropped)
            continue
        _sync()
        seconds[name] = round(time.perf_counter() - start, 1)
    return seconds


# Before each timed window a contender steps for STEADY_MS on its own, then TIMED_MS are timed
# (median step).  The GPUs run these steps at their board power cap, the SM clock following the
# last fraction of a second's power draw (an H100 at 700 W: 1200-1450 MHz), so a short window
# measures the contender that ran before as much as this one; and each round starts one
# contender later, so none always follows the same one.
STEADY_MS, TIMED_MS = 150, 300


def time_interleaved(contenders: dict, reps: int, smoke: bool) -> dict:
    """Wall time per contender, ms: median over `reps` rounds, each round every contender once
    (do_bench: the median step of TIMED_MS after STEADY_MS of steps; smoke: one perf_counter
    call), and the spread."""
    if smoke:
        def bench(f):
            start = time.perf_counter()
            f()
            return (time.perf_counter() - start) * 1e3
    else:
        from triton.testing import do_bench

        def bench(f):
            return do_bench(f, warmup=STEADY_MS, rep=TIMED_MS, return_mode="median")
    times = {k: [] for k in contenders}
    names = list(contenders)
    for round_ in range(reps):
        start = round_ % len(names)
        for name in names[start:] + names[:start]:
            times[name].append(bench(contenders[name]))
    return {k: {"ms": statistics.median(v), "spread": (max(v) - min(v)) / statistics.median(v)}
            for k, v in times.items()}


def peak_gib(contender: Contender):
    """Peak memory of one step above what was allocated before it (gradients None), GiB."""
    contender.clear()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = contender()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del out
    return peak / 2 ** 30


def peak_live(contender: Contender, top: int = 10) -> list[list]:
    """What one step holds at its peak, allocated during the step: [[GiB, where], ...], the largest
    sites first, where = the innermost frame in coda_cute/nn.py, this file or torch.compile's
    generated code (else the innermost Python frame), as `file:line function`.  From the caching
    allocator's trace (torch.cuda.memory._record_memory_history), replayed to the peak."""
    contender.clear()
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    try:
        out = contender()
        torch.cuda.synchronize()
        trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    del out
    live, total, peak, at_peak = {}, 0, 0, {}
    for event in trace:
        if event["action"] == "alloc":
            live[event["addr"]] = event
            total += event["size"]
        elif event["action"] == "free_completed" and event["addr"] in live:
            total -= live.pop(event["addr"])["size"]
        if total > peak:
            peak, at_peak = total, dict(live)
    sites: dict[str, int] = {}
    for event in at_peak.values():
        where = _site(event.get("frames") or [])
        sites[where] = sites.get(where, 0) + event["size"]
    ranked = sorted(sites.items(), key=lambda kv: -kv[1])
    return [[size / 2 ** 30, where] for where, size in ranked[:top]]


def _site(frames) -> str:
    def label(f):
        return f"{os.path.basename(f['filename'])}:{f['line']} {f['name']}"
    for f in frames:
        if f["filename"].endswith(("coda_cute/nn.py", "bench_block.py")) or "torchinductor" in f["filename"]:
            return label(f)
    return label(frames[0]) if frames else "?"


def profile_kernels(contender: Contender) -> list[tuple[str, float]]:
    """The GPU work of one step, (name, ms) per kernel (and memset / memcpy) in start order.  The
    step follows STEADY_MS of steps, as a timed window does: after the memory measurements left
    the GPU idle, a lone step would run at a clock that sustained steps do not hold."""
    start = time.perf_counter()
    while time.perf_counter() - start < STEADY_MS / 1e3:
        contender()
        torch.cuda.synchronize()
    return [(e.name, e.time_range.elapsed_us() / 1e3) for e in gpu_work(contender)]


def gpu_work(steps: Callable[[], object]) -> list:
    """The GPU work ``steps()`` queues (`_is_gpu_work`), as torch.profiler events in start order."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        steps()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == DeviceType.CUDA and _is_gpu_work(e)]
    return sorted(events, key=lambda e: e.time_range.start)


def back_to_back(contender: Contender) -> float:
    """ms per step of steps queued back to back for about TIMED_MS (at least 3 steps), after
    STEADY_MS of steps, between two CUDA events: no L2 flush between steps and no host wait (the
    host queues ahead of the GPU), so what the GPU does per step at the clock sustained steps hold."""
    start, steps = time.perf_counter(), 0
    while time.perf_counter() - start < STEADY_MS / 1e3:
        contender()
        steps += 1
    torch.cuda.synchronize()
    per_step = (time.perf_counter() - start) / steps
    n = max(3, round(TIMED_MS / 1e3 / per_step))
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(n):
        contender()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / n


def _is_gpu_work(event) -> bool:
    """Kernels, memcpy, memset; not the GPU-timeline copies of record_function ranges (user
    annotations) nor synchronization events, which span other work.  (`activity_type` is only
    in newer torch; older ones have neither sync events nor it.)"""
    kind = (getattr(event, "activity_type", None) or "").lower()
    return not getattr(event, "is_user_annotation", False) and "annotation" not in kind and "sync" not in kind


def _sync():
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _graphs_compiled():
    from torch._dynamo.utils import counters
    return counters["stats"]["unique_graphs"]


def measure_case(b: Bench, name: str, d: int) -> dict:
    """Build, check, warm up, time (interleaved), then memory and kernels of one step per contender."""
    clock = time.perf_counter()
    b.inputs(d)
    case = BUILDERS[name](b, d)
    dropped = {}
    errors = check(case, b.h, dropped)
    compile_s = warm_up(case, dropped)
    graphs = _graphs_compiled()
    row = {"d": d, "case": name, "what": CASES[name], "tokens": b.batch * b.seq, "floor_runs": case.floor, **case.notes}
    row.update(time_interleaved(case.contenders, b.args.reps, b.smoke))
    for key, contender in case.contenders.items():
        if b.smoke:
            row[key].update({k: None for k in ("b2b_ms", "gpu_ms", "gemm_ms", "attention_ms", "finish_ms", "other_ms")},
                            peak_gib=None, peak_live=[], gemm_kernels=[], other_kernels=[], finish_kernels=[])
        else:
            row[key]["peak_gib"] = peak_gib(contender)
            row[key]["peak_live"] = peak_live(contender)
            row[key]["b2b_ms"] = back_to_back(contender)
            kernels = profile_kernels(contender)
            row[key].update(summarize(kernels))
            if b.args.profile:
                _print_kernels(f"{name} / {key}, d={d}", kernels)
        if key in errors:
            row[key]["rel_err"] = errors[key]
    if _graphs_compiled() != graphs:
        print(f"  warning: torch.compile compiled {_graphs_compiled() - graphs} graph(s) after warm-up "
              "(a recompile inside the timed steps)", flush=True)
    row["bar"] = bar(row)
    row["warm_up_s"], row["dropped"] = compile_s, dropped
    print(f"{CASES[name]} d={d}: {time.perf_counter() - clock:.0f} s (warm-up {compile_s})", flush=True)
    return row


def bar(row: dict) -> dict | None:
    """floor + (best torch.compile - floor) / 3, in wall, GPU and back-to-back time; per coda-cute
    contender whether it is under the bar, and its peak memory over the best (lowest) torch.compile's."""
    compiled = [k for k in row if k.startswith("torch.compile") and isinstance(row[k], dict)]
    if not compiled or FLOOR not in row:
        return None
    out = {"best_compile": {}}
    bars = {"ms": "wall_bar_ms", "gpu_ms": "gpu_bar_ms", "b2b_ms": "b2b_bar_ms"}
    for metric in (*bars, "peak_gib"):
        measured = [k for k in compiled if row[k].get(metric) is not None]
        best = min(measured, key=lambda k: row[k][metric]) if measured else None
        out["best_compile"][metric] = best
        value, floor = (row[best][metric], row[FLOOR][metric]) if best else (None, None)
        if metric in bars:
            out[bars[metric]] = None if value is None or floor is None else floor + (value - floor) / 3
    for ours in [k for k in row if k.startswith(CODA) and isinstance(row[k], dict)]:
        entry = {}
        for metric, bar_key, label in (("ms", "wall_bar_ms", "under_wall"), ("gpu_ms", "gpu_bar_ms", "under_gpu"),
                                       ("b2b_ms", "b2b_bar_ms", "under_b2b")):
            value = row[ours].get(metric)
            entry[label] = None if out[bar_key] is None or value is None else value < out[bar_key]
        best = out["best_compile"]["peak_gib"]
        entry["peak_ratio"] = row[ours]["peak_gib"] / row[best]["peak_gib"] if best and row[best]["peak_gib"] else None
        out[ours] = entry
    return out


# ----------------------------------------------------------------------------------- output
def _print_kernels(title, kernels):
    print(f"--- {title}", flush=True)
    for name, ms in kernels:
        print(f"  {ms:9.4f} ms  {kernel_kind(name):9s}  {_display(short_name(name), 110)}")


def _display(name, width):
    """A kernel name for the terminal: without `void ` and the at::native namespaces, cut at width."""
    for noise in ("void ", "at::native::", "(anonymous namespace)::"):
        name = name.replace(noise, "")
    return name[:width]


def _fmt(value, spec):
    return "-" if value is None else format(value, spec)


def print_row(row: dict):
    """The case's contenders: wall, GPU split, memory; coda-cute's non-GEMM kernels summed by name; the bar."""
    print(f"\n== {row['what']}, d={row['d']} (floor: {row['floor_runs']})")
    print(f"  {'contender':42s} {'wall ms':>9s} {'spread':>7s} {'b2b ms':>9s} {'GPU ms':>9s} {'GEMM':>9s} "
          f"{'attn':>8s} {'finish':>7s} {'other':>8s} {'peak GiB':>9s}")
    for key, v in _contenders(row):
        print(f"  {key:42s} {v['ms']:9.3f} {v['spread']:6.1%} {_fmt(v.get('b2b_ms'), '9.3f')} "
              f"{_fmt(v['gpu_ms'], '9.3f')} "
              f"{_fmt(v.get('gemm_ms'), '9.3f')} {_fmt(v.get('attention_ms'), '8.3f')} "
              f"{_fmt(v.get('finish_ms'), '7.3f')} {_fmt(v.get('other_ms'), '8.3f')} {_fmt(v['peak_gib'], '9.2f')}")
    for key, v in _contenders(row):
        if key.startswith(CODA) and (v["other_kernels"] or v["finish_kernels"]):
            summed = {}
            for name, ms in v["finish_kernels"] + v["other_kernels"]:
                summed[name] = summed.get(name, 0.0) + ms
            print(f"  {key}: non-GEMM kernels, ms: " + "; ".join(
                f"{ms:.3f} {_display(name, 80)}" for name, ms in sorted(summed.items(), key=lambda kv: -kv[1])))
    for key, v in _contenders(row):
        if (key.startswith(CODA) or key == FLOOR) and v.get("gemm_kernels"):
            print(f"  {key}: GEMMs in launch order, ms: " + "; ".join(
                f"{ms:.3f} {_display(name, 40)}" for name, ms in v["gemm_kernels"]))
    if row.get("gradient_gib") is not None and all(v["peak_gib"] is not None for _, v in _contenders(row)):
        print(f"  peak above the gradients ({row['gradient_gib']:.2f} GiB), GiB: " + "; ".join(
            f"{key} {v['peak_gib'] - row['gradient_gib']:.2f}" for key, v in _contenders(row)))
    for key, v in _contenders(row):
        if v.get("peak_live") and (key.startswith(CODA) or key.startswith("torch.compile")):
            print(f"  {key}: live at the peak, GiB: " + "; ".join(f"{gib:.3f} {where}" for gib, where in v["peak_live"]))
    _print_bar(row)


def _print_bar(row):
    b = row.get("bar")
    if not b:
        print("  bar: needs torch.compile and the floor")
        return
    best = b["best_compile"]
    print(f"  bar = floor + (best torch.compile - floor) / 3: wall {_fmt(b['wall_bar_ms'], '.3f')} ms "
          f"(best: {best['ms']}), GPU {_fmt(b['gpu_bar_ms'], '.3f')} ms (best: {best['gpu_ms']}), back to back "
          f"{_fmt(b.get('b2b_bar_ms'), '.3f')} ms (best: {best.get('b2b_ms')})")
    for key, v in _contenders(row):
        if key in b:
            e = b[key]
            print(f"  {key}: under the bar in wall time: {e['under_wall']}, in GPU time: {e['under_gpu']}, "
                  f"back to back: {e.get('under_b2b')}; "
                  f"peak memory / best torch.compile's ({best['peak_gib']}): {_fmt(e['peak_ratio'], '.2f')}")


def _contenders(row):
    return [(k, v) for k, v in row.items() if isinstance(v, dict) and "ms" in v]


def print_summary(rows):
    print("\n== summary: wall ms / back-to-back ms / GPU ms / peak GiB")
    for row in rows:
        cells = "  ".join(f"{k}: {v['ms']:.3f}/{_fmt(v.get('b2b_ms'), '.3f')}/{_fmt(v['gpu_ms'], '.3f')}/"
                          f"{_fmt(v['peak_gib'], '.2f')}" for k, v in _contenders(row))
        print(f"{row['case']:5s} d={row['d']:<5d} {cells}")
        if row.get("bar"):
            for key in [k for k in row["bar"] if k.startswith(CODA)]:
                e = row["bar"][key]
                print(f"{'':13s}{key} under the bar: wall {e['under_wall']}, back to back {e.get('under_b2b')}, "
                      f"GPU {e['under_gpu']}; "
                      f"peak ratio {_fmt(e['peak_ratio'], '.2f')}")


def commit(checkout: str | None = None) -> str:
    """The commit a result file names: $CODA_COMMIT where set, else the HEAD of ``checkout`` (this
    one by default), with "+changes" where tracked files differ from it (a working tree copied
    onto a machine whose git copy sits at another commit reads so, instead of naming a commit
    that did not run)."""
    if os.environ.get("CODA_COMMIT"):
        return os.environ["CODA_COMMIT"]

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, timeout=10,
                              cwd=checkout or os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    try:
        head = git("rev-parse", "--short", "HEAD")
        changed = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head + "+changes" if changed else head) or "unknown"


def write(path, rows, smoke, extra: dict | None = None, machine: str | None = None):
    """The result file: {"meta": {date, gpu, torch, commit, command}, "rows": rows, **extra}; a
    CPU benchmark names its ``machine`` instead of the GPU."""
    where = {"machine": machine} if machine else {"gpu": "cpu (--smoke)" if smoke else torch.cuda.get_device_name()}
    meta = {"date": time.strftime("%Y-%m-%d"), **where, "torch": torch.__version__, "commit": commit(),
            "command": "python " + " ".join(map(shlex.quote, sys.argv))}
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows, **(extra or {})}, f, indent=1)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--d", type=int, nargs="+", default=[4096], choices=sorted(SHAPES))
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=5, help="interleaved rounds of do_bench per contender")
    parser.add_argument("--vocab", type=int, default=128256, help="LM head + cross-entropy case (0: skip it)")
    parser.add_argument("--out", default="block.json")
    parser.add_argument("--compile-modes", nargs="*", default=list(COMPILE_MODES), choices=COMPILE_MODES,
                        help="torch.compile modes to time (none: no torch.compile contender, no bar)")
    parser.add_argument("--cases", nargs="+", choices=list(CASES), help="only these cases (default: all)")
    parser.add_argument("--profile", action="store_true", help="also print every kernel of each contender's step")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shapes: the plumbing only")
    args = parser.parse_args(argv)
    if args.smoke:
        args.d, args.tokens, args.seq, args.vocab = [SMOKE["d"]], SMOKE["tokens"], SMOKE["seq"], SMOKE["vocab"]
        args.reps = min(args.reps, 2)
    return args


def main(argv=None):
    args = parse_args(argv)
    torch.manual_seed(0)
    b = Bench(args)
    cases = [c for c in CASES if (not args.cases or c in args.cases) and (c != "LM" or args.vocab)]
    rows = []
    for d in args.d:
        for name in cases:
            rows.append(measure_case(b, name, d))
            print_row(rows[-1])
            write(args.out, rows, args.smoke)  # after every case: a run cut short keeps what it measured
    print_summary(rows)


if __name__ == "__main__":
    main()

"""Transformer blocks as GEMM + epilogue programs, autograd-aware.

``LlamaMLP`` is the pre-norm SwiGLU MLP of a Llama block with its residual:

    h_out = h + W_down @ (silu(gate) * up),   (gate, up) = W_gate_up @ (rmsnorm(h) * gamma)

rewritten as two GEMMs whose epilogues do everything else (CODA):

forward
  1. rstd = rsqrt(sumsq / d + eps) per row, from the `sumsq` the previous block's
     residual GEMM produced (without one: a single compiled pass over h gives rstd and
     h * gamma together, `rms_statistics`);
  2. gamma scales K, so it goes into one GEMM operand, redone every call so that it trains:
     in ``LlamaBlock`` the attention's O projection stores h * gamma beside h in its epilogue
     (`residual_sumsq_scaled`); standing alone, the smaller of h * gamma and W_gate_up * gamma
     (`_norm_operands`);
  3. `rms_swiglu_save`: z = rstd * ((h * gamma) @ W_gate_up.T), a = silu(gate) * up; z is saved;
  4. `residual_sumsq`: h_out = h + a @ W_down.T, plus sum(h_out^2) per row for the next norm.
backward (dh_out)
  5. `swiglu_bwd_recompute`: dz = SwiGLU'(z) * (dh_out @ W_down), written over z (the op
     mutates its operand: one tokens x 2 ffn buffer through the backward), a recomputed (not
     saved), and rowdot = sum(dz * z) per row, which equals the norm's row statistic
     sum(dy * y) (y the normalized input, dy = dz @ W_gate_up its gradient);
  6. dW_down = dh_out.T @ a (a plain GEMM); a is released before the next GEMM allocates;
  7. x = h * rstd * gamma, the normalized input (one compiled pass, `normalized_input`; not
     saved from the forward), then dW_gate_up = dz.T @ x (a plain GEMM), and x is released;
  8. `rmsnorm_bwd_rowdot`: in the dgrad dz @ W_gate_up, the whole
     dh = (dy * gamma - h * rstd * rowdot / d) * rstd + dh_out and dgamma partials.  After
     the weight gradient, so x and dh are never live together: the backward's peak holds dz,
     dW_gate_up and one tokens x d buffer, as torch.compile's does.

GEMMs with nothing to fuse (weight gradients, the O projection's dgrad) call cuBLAS
through ``torch.matmul``: coda-cute's own plain GEMM runs at 0.97-1.01x cuBLAS on the H200
(benchmarks/results), so the fused programs are used exactly where they remove memory traffic.

``LlamaAttention`` does the same for the attention half: `rms_rope_qkv` (norm scale and
RoPE in the QKV GEMM's epilogue; q/k weight rows in interleaved-pair order, see
``rotate_half_to_interleaved``), PyTorch SDPA for attention itself, and `residual_sumsq`
for the O projection (`residual_sumsq_scaled` in a block, see step 2); q, k and v are
views of the one buffer the QKV GEMM wrote.  RoPE's backward (the inverse rotation of dq,
dk) acts on the QKV dgrad's *input*: `qkv_gradient` rotates dq and dk back and lays dq, dk,
dv out as that GEMM's input in one compiled pass (no concatenation), taking the norm's row
statistic sum(dq * q + dk * k + dv * v) on the way (a rotation keeps dot products), and the
dgrad's epilogue is `rmsnorm_bwd_rowdot` as in the MLP: the residual stream h passes through
the QKV step's autograd function, so its gradient arrives there to join in the epilogue.
``LlamaBlock`` chains the two, passing the residual statistics from one to the next.

On CPU tensors every program runs in the reference interpreter, so the modules also
work (slowly) without a GPU.  The gate/up weight holds gate and up rows interleaved:
``interleave_gate_up`` / ``split_gate_up`` convert from and to the usual two matrices.
"""

from __future__ import annotations

import torch
from torch import nn

from . import library
from .errors import ArgumentError
from .ops import library_op, one_pass, trainable_chain


def interleave_gate_up(w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    """(F, d) gate and up projections -> one (2F, d) weight with rows gate_0, up_0, gate_1, ..."""
    if w_gate.shape != w_up.shape:
        raise ValueError(f"gate {tuple(w_gate.shape)} and up {tuple(w_up.shape)} projections must have one shape")
    return torch.stack([w_gate, w_up], dim=1).reshape(2 * w_gate.shape[0], w_gate.shape[1])


def split_gate_up(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of ``interleave_gate_up``."""
    return w[0::2], w[1::2]


def rotate_half_to_interleaved(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Reorder q or k projection rows from the rotate-half convention (Hugging Face Llama: pairs
    (i, i + head_dim/2) per head) into interleaved pairs (2i, 2i + 1), which one thread holds."""
    heads = _heads(w, head_dim)
    return w.reshape(heads, 2, head_dim // 2, -1).transpose(1, 2).reshape(w.shape)


def interleaved_to_rotate_half(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Inverse of ``rotate_half_to_interleaved``."""
    heads = _heads(w, head_dim)
    return w.reshape(heads, head_dim // 2, 2, -1).transpose(1, 2).reshape(w.shape)


def _heads(w: torch.Tensor, head_dim: int) -> int:
    if head_dim % 2 or w.shape[0] % head_dim:
        raise ValueError(f"{w.shape[0]} rows are not whole heads of an even head_dim {head_dim}")
    return w.shape[0] // head_dim


# registered at import, so torch.compile traces straight to the ops (no file access while tracing)
_OPS = {name: library_op(library.get(name))
        for name in ("rms_swiglu_save", "residual_sumsq", "residual_sumsq_scaled", "rmsnorm_bwd_rowdot",
                     "cross_entropy_stats", "cross_entropy_stats_save", "cross_entropy_exp_save",
                     "cross_entropy_bwd")}
# the pre-activation's gradient written over the saved pre-activation (ops.library_op): one
# tokens x 2 ffn buffer instead of two through the backward
_OPS["swiglu_bwd_recompute"] = library_op(library.get("swiglu_bwd_recompute"), overwrite={"D": "preact"})


class _LlamaMLPFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, sumsq, gamma, w_gate_up, w_down, eps, scaled):
        ops = _OPS
        h2 = h.reshape(-1, h.shape[-1])
        scaled = None if scaled is None else scaled.reshape(h2.shape)
        a_in, b_in, rstd = _norm_operands(h2, sumsq, gamma, w_gate_up, eps, scaled)
        a, z = ops["rms_swiglu_save"](a_in, b_in, rstd)
        h_out, sumsq_out = ops["residual_sumsq"](a, w_down, h2)
        ctx.save_for_backward(h2, rstd, z, gamma, w_gate_up, w_down)
        ctx.shape = h.shape
        ctx.mark_non_differentiable(sumsq_out)
        ctx.set_materialize_grads(False)  # no zeros made for the statistics' gradient
        return h_out.reshape(h.shape), sumsq_out.reshape(h.shape[:-1])

    @staticmethod
    def backward(ctx, dh_out, _dsumsq):
        if dh_out is None:  # only the statistics were used
            return (None,) * 7
        ops = _OPS
        h, rstd, z, gamma, w_gate_up, w_down = ctx.saved_tensors
        d = h.shape[-1]
        dy = dh_out.reshape(-1, d).to(h.dtype).contiguous()
        a, rowdot = ops["swiglu_bwd_recompute"](dy, w_down.t(), z)  # z now holds dz, its gradient
        dw_down = dy.t() @ a  # plain GEMM: cuBLAS (module docstring)
        del a  # before the dgrad's outputs are allocated: the backward's peak memory
        dh, dgamma, dw_gate_up = _rmsnorm_backward(ops, z, w_gate_up, h, rstd, gamma, dy, rowdot)
        return dh.to(dh_out.dtype).reshape(ctx.shape), None, dgamma, dw_gate_up, dw_down, None, None


def _rmsnorm_backward(ops, d_pre, w, h, rstd, gamma, dh_residual, rowdot):
    """Gradients through `h + g(rstd * (h @ (w * gamma).T))` given d_pre, the gradient of the
    GEMM's output pre, dh_residual, the gradient reaching h through the residual stream, and
    rowdot = sum(d_pre * pre) per row (the norm's row statistic, taken where d_pre was made):
    (dh, dgamma, dw).  The weight gradient comes first, from the normalized input made in one
    pass and released after it; then the dgrad, whose epilogue (`rmsnorm_bwd_rowdot`) makes the
    whole dh, the residual gradient included."""
    x = one_pass(normalized_input, h)(h, rstd, gamma)
    dw = d_pre.t() @ x
    del x  # before the dgrad allocates dh: the two are never live together
    dh, dgamma = ops["rmsnorm_bwd_rowdot"](d_pre, w.t(), h, rstd, gamma, dh_residual, rowdot, 1.0 / h.shape[-1])
    return dh, dgamma.to(gamma.dtype), dw


def normalized_input(h: torch.Tensor, rstd: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    """x = h * rstd * gamma in h's dtype (fp32 products, rounded once): RMSNorm's output, the
    input of the next GEMM's weight gradient (`ops.one_pass` makes it one kernel)."""
    return (h.float() * rstd[:, None] * gamma.float()).to(h.dtype)


def _norm_operands(h: torch.Tensor, sumsq, gamma: torch.Tensor, w: torch.Tensor, eps: float,
                   scaled: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(a, b, rstd): the GEMM operands of (rmsnorm(h) * gamma) @ w.T = rstd * ((a @ b.T)), rstd per
    row applied in the epilogue.  gamma scales the reduction dimension K, so it goes into one
    operand, redone every call so that gamma trains:
    - ``scaled``, h * gamma as the residual GEMM that made h stored it (`residual_sumsq_scaled`):
      a = scaled, nothing to compute;
    - no statistics (``sumsq`` None: no GEMM made h): one pass over h (`rms_statistics`) gives
      rstd and h * gamma together, where that costs no more than scaling the weight (the pass
      reads h anyway, so it adds one write of h: no more traffic while tokens <= 2 x the weight's
      rows, and at equal traffic one kernel beats the weight's five: the d = 2048 block's QKV, at
      exactly 2 x, took 0.053 ms of GPU time that way against the pass's 0.022 on an H100);
    - else into the smaller operand, h * gamma or w * gamma (one elementwise kernel each)."""
    if scaled is not None:
        return scaled, w, _rstd(h, sumsq, eps)
    if sumsq is None and h.shape[0] <= 2 * w.shape[0]:
        rstd, scaled = one_pass(rms_statistics, h)(h, gamma, eps)
        return scaled, w, rstd
    rstd = _rstd(h, sumsq, eps)
    return (_times(h, gamma), w, rstd) if h.shape[0] < w.shape[0] else (h, _times(w, gamma), rstd)


def _times(t: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    """t * gamma over t's last dimension in t's dtype (16-bit products in fp32, rounded once)."""
    return t * gamma if gamma.dtype == t.dtype else (t.float() * gamma.float()).to(t.dtype)


def rms_statistics(h: torch.Tensor, gamma: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rstd, h * gamma): the row statistic of RMSNorm, rsqrt(mean(h^2) + eps) in fp32, and h scaled
    by gamma in h's dtype (the next GEMM's input, normalized by rstd in its epilogue), written so
    that one pass over h computes both (`ops.one_pass`)."""
    return row_rstd(h, None, eps), (h.float() * gamma.float()).to(h.dtype)


def _rstd(h2: torch.Tensor, sumsq, eps: float) -> torch.Tensor:
    return one_pass(row_rstd, h2)(h2, sumsq, eps)


def row_rstd(h: torch.Tensor, sumsq: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm's row statistic rsqrt(mean(h^2) + eps) in fp32, from ``sumsq`` (each row's sum of
    squares, fp32, as a residual GEMM returns it) or, where that is None (the first block: no GEMM
    made h), from h by one fp32 reduction.  One kernel either way (`ops.one_pass`), where plain
    torch ran three (five from h): in a step queued back to back each costs a launch's gap."""
    mean_square = h.float().square().mean(-1) if sumsq is None else sumsq.reshape(-1) / h.shape[-1]
    return torch.rsqrt(mean_square + eps)


def _check_input(who: str, h, sumsq, weight: torch.Tensor, dims: int | None = None) -> None:
    """The module's input ``h`` (..., d) and the statistics ``sumsq`` (None, or h's leading shape),
    checked against its weights (``weight``: one parameter, whose dtype and device h must share)."""
    d = weight.shape[-1]
    if not isinstance(h, torch.Tensor) or h.dim() < 2 or (dims and h.dim() != dims):
        shape = "(batch, seq, d)" if dims == 3 else "(..., d)"
        got = tuple(h.shape) if isinstance(h, torch.Tensor) else type(h).__name__
        raise ArgumentError(f"{who}: h must be a tensor of shape {shape} with d = {d}, got {got}")
    if h.shape[-1] != d or h.dtype != weight.dtype or h.device != weight.device:
        raise ArgumentError(f"{who}: h must be (..., {d}) {weight.dtype} on {weight.device} like the module's weights, "
                            f"got {tuple(h.shape)} {h.dtype} on {h.device}")
    tokens = h.numel() // d
    if tokens == 0 or (h.is_cuda and tokens % 8):
        raise ArgumentError(
            f"{who}: h has {tokens} tokens (all dims but the last); on the GPU their number must be a positive "
            "multiple of 8: the weight-gradient GEMMs reduce over tokens and TMA needs 16-byte rows"
        )
    if sumsq is not None and (not isinstance(sumsq, torch.Tensor) or tuple(sumsq.shape) != tuple(h.shape[:-1])
                              or sumsq.dtype != torch.float32 or sumsq.device != h.device):
        got = f"{tuple(sumsq.shape)} {sumsq.dtype}" if isinstance(sumsq, torch.Tensor) else type(sumsq).__name__
        raise ArgumentError(f"{who}: sumsq must be None or a float32 tensor of h's leading shape "
                            f"{tuple(h.shape[:-1])} (each row's sum of squares), got {got}")


class LlamaMLP(nn.Module):
    """RMSNorm + SwiGLU MLP + residual of a Llama block, as two fused GEMMs each way.

    ``forward(h, sumsq=None) -> (h_out, sumsq_out)``: ``sumsq`` (per row sum of h^2, as the
    previous block's residual GEMM returns it) saves the norm's statistics pass; it carries
    no gradient (the norm's backward differentiates through h itself).
    """

    def __init__(self, d: int, ffn: int, eps: float = 1e-6, dtype=torch.bfloat16, device=None):
        super().__init__()
        self.d, self.ffn, self.eps = d, ffn, eps
        self.gamma = nn.Parameter(torch.ones(d, dtype=dtype, device=device))
        self.w_gate_up = nn.Parameter(torch.empty(2 * ffn, d, dtype=dtype, device=device))
        self.w_down = nn.Parameter(torch.empty(d, ffn, dtype=dtype, device=device))
        nn.init.normal_(self.w_gate_up, std=d ** -0.5)
        nn.init.normal_(self.w_down, std=ffn ** -0.5)

    def forward(self, h: torch.Tensor, sumsq: torch.Tensor | None = None):
        return self._forward(h, sumsq, None)

    def _forward(self, h: torch.Tensor, sumsq: torch.Tensor | None, scaled: torch.Tensor | None):
        """forward, given ``scaled`` = h * gamma where the GEMM that made h stored it (``LlamaBlock``)."""
        _check_input("LlamaMLP", h, sumsq, self.w_down.t())
        return _LlamaMLPFunction.apply(h, sumsq, self.gamma, self.w_gate_up, self.w_down, self.eps, scaled)

    @torch.no_grad()
    def load_hf(self, norm_weight: torch.Tensor, gate_proj: torch.Tensor, up_proj: torch.Tensor,
                down_proj: torch.Tensor) -> "LlamaMLP":
        """Take a Hugging Face Llama layer's post_attention_layernorm.weight and mlp.{gate,up,down}_proj.weight."""
        self.gamma.copy_(norm_weight)
        self.w_gate_up.copy_(interleave_gate_up(gate_proj, up_proj))
        self.w_down.copy_(down_proj)
        return self

    def hf_weights(self) -> dict:
        """The Hugging Face layout of this module's weights (inverse of ``load_hf``)."""
        gate, up = split_gate_up(self.w_gate_up.detach())
        return {"post_attention_layernorm.weight": self.gamma.detach(), "mlp.gate_proj.weight": gate,
                "mlp.up_proj.weight": up, "mlp.down_proj.weight": self.w_down.detach()}


_ROPE_OPS: dict = {}


def _rope_op(rotary_cols: int):
    """The `rms_rope_qkv` op for this many rotary columns, made once per count.  LlamaAttention
    makes its own when built, so that under torch.compile forward only looks it up here (making
    one reads epilogues/, which fullgraph tracing cannot follow)."""
    op = _ROPE_OPS.get(rotary_cols)
    if op is None:
        op = _ROPE_OPS[rotary_cols] = library_op(library.get("rms_rope_qkv").with_constants(rotary_cols=rotary_cols))
    return op


def qkv_gradient(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(d_pre, rowdot): d_pre, the gradient of the QKV GEMM's output, (tokens, (q + k + v heads) *
    head_dim) in dq's dtype, from attention's dq, dk, dv ((batch, heads, seq, head_dim)): q and k
    rotated back (RoPE's backward, each interleaved pair (2i, 2i + 1) turned by minus its angle at
    (position, i)) and all three laid out as the GEMM wrote them; rowdot, (tokens,) fp32, the sum of
    d_pre * pre over each token's row, pre being the GEMM's output before RoPE, which is the sum of
    dq * q + dk * k + dv * v over the attention inputs q, k, v (a rotation keeps dot products).
    On the GPU `ops.one_pass` compiles it (autograd would concatenate them first, then rotate).

    Everything is written over one index space, (batch, seq, all heads, pairs), the layout of
    d_pre and of the QKV buffer q, k, v are views of: the row dot is a reduction over the last two
    dimensions of the very pairs the rotation reads, so Inductor makes the whole of it one kernel
    (the row dot taken over attention's (batch, heads, seq, head_dim) order was two more kernels
    reading dq, q, dk, k, dv and v again).  16-bit gradients are handled as 32-bit words, one
    pair each (`_pair_words`): Inductor then loads and stores whole words, where pairing single
    elements made it gather 2-byte values (the pass ran at 1.2-1.4 TB/s on the H100 against 2.8
    for a copy of the same tensor)."""
    batch, n_q, seq, head_dim = dq.shape
    n_kv = dk.shape[1]
    words = dq.element_size() == 2

    def pairs(*parts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The pairs of (batch, heads, seq, head_dim) parts side by side, (batch, seq, heads, pairs) x 2, fp32."""
        if words:
            return _word_halves(torch.cat([_pair_words(t.transpose(1, 2)) for t in parts], dim=2), dq.dtype)
        t = torch.cat([t.transpose(1, 2) for t in parts], dim=2)
        return t[..., 0::2].float(), t[..., 1::2].float()

    g0, g1 = pairs(dq, dk, dv)
    p0, p1 = pairs(q, k, v)
    rowdot = (g0 * p0 + g1 * p1).sum(dim=(2, 3))
    turned = (torch.arange(n_q + 2 * n_kv, device=dq.device) < n_q + n_kv)[:, None]  # q and k heads, not v's
    c, s = cos[:seq].float()[:, None, :], sin[:seq].float()[:, None, :]  # (seq, 1, pairs)
    # each q, k pair (g0, g1) turned by minus its angle; v's as they are (no multiply: an inf stays one)
    y0, y1 = torch.where(turned, g0 * c + g1 * s, g0), torch.where(turned, g1 * c - g0 * s, g1)
    if words:
        d_pre = _halves_word(y0, y1, dq.dtype).view(dq.dtype)
    else:
        d_pre = torch.stack([y0, y1], dim=-1).flatten(-2).to(dq.dtype)
    return d_pre.reshape(batch * seq, -1), rowdot.reshape(batch * seq)


def _pair_words(t: torch.Tensor) -> torch.Tensor:
    """A 16-bit tensor (..., 2n) as int32 words (..., n): word i holds elements 2i (its low half,
    little-endian) and 2i + 1 (its high half)."""
    # an odd start is seen in eager mode only: torch.compile cannot trace storage_offset() (it
    # breaks the graph there); compiled, the callers pass fresh gradients, and a view that
    # cannot be reread fails while tracing
    odd_start = not torch.compiler.is_compiling() and t.storage_offset() % 2
    if t.stride(-1) != 1 or odd_start or any(stride % 2 for stride in t.stride()[:-1]):
        t = t.clone(memory_format=torch.contiguous_format)  # a copy from offset 0 (contiguous() may keep t)
    return t.view(torch.int32)


def _word_halves(w: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The two 16-bit ``dtype`` values of each int32 word (low, high), in fp32."""
    return w.to(torch.int16).view(dtype).float(), (w >> 16).to(torch.int16).view(dtype).float()


def _halves_word(low: torch.Tensor, high: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of `_word_halves`: both rounded to ``dtype``, packed into int32 words."""
    def bits(x):
        return x.to(dtype).view(torch.int16).to(torch.int32)
    return (bits(low) & 0xFFFF) | (bits(high) << 16)


def _qkv_heads(qkv: torch.Tensor, batch: int, seq: int, heads) -> tuple[torch.Tensor, ...]:
    """q, k, v as (batch, heads, seq, head_dim) views of the QKV GEMM's (tokens, ...) output."""
    n_heads, n_kv_heads, head_dim = heads
    parts = qkv.split([n_heads * head_dim, n_kv_heads * head_dim, n_kv_heads * head_dim], dim=-1)
    return tuple(t.view(batch, seq, -1, head_dim).transpose(1, 2) for t in parts)


class _NormQKVRope(torch.autograd.Function):
    """q, k, v = heads of rope(rstd * (h @ (w_qkv * gamma).T)), as (batch, heads, seq, head_dim)
    views of the one buffer the GEMM wrote, and h itself passed through as the residual stream,
    so that the residual's gradient reaches this backward and joins the norm's gradient in the
    dgrad epilogue (instead of autograd adding the two afterwards).  Its backward takes attention's
    dq, dk, dv as they come and makes the dgrad's input in one pass (`qkv_gradient`)."""

    @staticmethod
    def forward(ctx, h, sumsq, gamma, w_qkv, cos, sin, heads, eps):
        n_heads, n_kv_heads, head_dim = heads
        batch, seq, _ = h.shape
        h2 = h.reshape(-1, h.shape[-1])
        a_in, b_in, rstd = _norm_operands(h2, sumsq, gamma, w_qkv, eps)
        qkv = _rope_op((n_heads + n_kv_heads) * head_dim)(a_in, b_in, rstd, cos, sin)
        # qkv costs no memory: attention saves q, k and v, views of it, for its own backward
        ctx.save_for_backward(h2, rstd, gamma, w_qkv, cos, sin, qkv)
        ctx.shape, ctx.heads = h.shape, heads
        return (*_qkv_heads(qkv, batch, seq, heads), h.view(h.shape))

    @staticmethod
    def backward(ctx, dq, dk, dv, dresidual):
        h, rstd, gamma, w_qkv, cos, sin, qkv = ctx.saved_tensors
        q, k, v = _qkv_heads(qkv, ctx.shape[0], ctx.shape[1], ctx.heads)
        d_pre, rowdot = one_pass(qkv_gradient, dq)(dq, dk, dv, q, k, v, cos, sin)
        dresidual = dresidual.reshape(h.shape).to(h.dtype).contiguous()
        dh, dgamma, dw = _rmsnorm_backward(_OPS, d_pre.to(h.dtype), w_qkv, h, rstd, gamma, dresidual, rowdot)
        return dh.to(dq.dtype).reshape(ctx.shape), None, dgamma, dw, None, None, None, None


class _LinearResidual(torch.autograd.Function):
    """h_out = residual + x @ w.T, with the next norm's per-row sum of squares and, given that
    norm's ``next_gamma``, h_out * next_gamma for the next GEMM's input (not differentiated
    here: the next module differentiates its own norm through h_out)."""

    @staticmethod
    def forward(ctx, x, w, residual, next_gamma):
        x2, r2 = x.reshape(-1, x.shape[-1]), residual.reshape(-1, residual.shape[-1])
        if next_gamma is None:
            (h_out, sumsq), scaled = _OPS["residual_sumsq"](x2, w, r2), None
        else:
            h_out, sumsq, scaled = _OPS["residual_sumsq_scaled"](x2, w, r2, next_gamma)
            ctx.mark_non_differentiable(scaled)
        ctx.save_for_backward(x2, w)
        ctx.shapes = (x.shape, residual.shape)
        ctx.mark_non_differentiable(sumsq)
        # no zeros made for the gradients of the statistics and the scaled copy (tokens x d)
        ctx.set_materialize_grads(False)
        return h_out.reshape(residual.shape), sumsq.reshape(residual.shape[:-1]), scaled

    @staticmethod
    def backward(ctx, dh_out, _dsumsq, _dscaled):
        if dh_out is None:  # only the statistics or the scaled copy were used
            return None, None, None, None
        x, w = ctx.saved_tensors
        dy = dh_out.reshape(-1, dh_out.shape[-1]).to(x.dtype).contiguous()
        dx = dy @ w  # plain GEMMs: cuBLAS (module docstring)
        dw = dy.t() @ x
        return dx.reshape(ctx.shapes[0]), dw, dh_out, None


class LlamaAttention(nn.Module):
    """RMSNorm + QKV projection with RoPE + causal attention (PyTorch SDPA) + O projection and
    residual, as fused GEMM+epilogue programs.  ``forward(h, sumsq=None) -> (h_out, sumsq_out)``
    with h of shape (batch, seq, d).  q and k weight rows are stored in interleaved-pair order
    (``load_hf`` converts); grouped-query attention when n_kv_heads < n_heads."""

    def __init__(self, d: int, n_heads: int, n_kv_heads: int | None = None, head_dim: int | None = None,
                 eps: float = 1e-6, rope_theta: float = 10000.0, max_positions: int = 4096,
                 dtype=torch.bfloat16, device=None):
        super().__init__()
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads or n_heads
        self.head_dim = head_dim or d // n_heads
        self.d, self.eps = d, eps
        rows = (self.n_heads + 2 * self.n_kv_heads) * self.head_dim
        self.gamma = nn.Parameter(torch.ones(d, dtype=dtype, device=device))
        self.w_qkv = nn.Parameter(torch.empty(rows, d, dtype=dtype, device=device))
        self.w_o = nn.Parameter(torch.empty(d, self.n_heads * self.head_dim, dtype=dtype, device=device))
        nn.init.normal_(self.w_qkv, std=d ** -0.5)
        nn.init.normal_(self.w_o, std=(self.n_heads * self.head_dim) ** -0.5)
        inv_freq = rope_theta ** (-torch.arange(0, self.head_dim, 2, dtype=torch.float64, device=device) / self.head_dim)
        angles = torch.arange(max_positions, dtype=torch.float64, device=device)[:, None] * inv_freq[None, :]
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)
        _rope_op((self.n_heads + self.n_kv_heads) * self.head_dim)  # registered now, looked up in forward

    def forward(self, h: torch.Tensor, sumsq: torch.Tensor | None = None):
        h_out, sumsq_out, _ = self._forward(h, sumsq, None)
        return h_out, sumsq_out

    def _forward(self, h: torch.Tensor, sumsq: torch.Tensor | None, next_gamma: torch.Tensor | None):
        """(h_out, sumsq_out, h_out * next_gamma or None): the next norm's scale applied in the O
        projection's epilogue (``LlamaBlock``)."""
        _check_input("LlamaAttention", h, sumsq, self.w_qkv, dims=3)
        batch, seq, _ = h.shape
        if seq > self.cos.shape[0]:
            raise ArgumentError(f"LlamaAttention: a sequence of {seq} positions is longer than max_positions = "
                                f"{self.cos.shape[0]} (the RoPE tables' length)")
        hd, nq, nkv = self.head_dim, self.n_heads, self.n_kv_heads
        q, k, v, residual = _NormQKVRope.apply(h, sumsq, self.gamma, self.w_qkv, self.cos[:seq], self.sin[:seq],
                                               (nq, nkv, hd), self.eps)
        attn = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=nq != nkv)
        attn = attn.transpose(1, 2).reshape(batch, seq, nq * hd)
        return _LinearResidual.apply(attn, self.w_o, residual, next_gamma)

    @torch.no_grad()
    def load_hf(self, norm_weight, q_proj, k_proj, v_proj, o_proj) -> "LlamaAttention":
        """Take a Hugging Face Llama layer's input_layernorm.weight and self_attn.{q,k,v,o}_proj.weight."""
        self.gamma.copy_(norm_weight)
        self.w_qkv.copy_(torch.cat([rotate_half_to_interleaved(q_proj, self.head_dim),
                                    rotate_half_to_interleaved(k_proj, self.head_dim), v_proj]))
        self.w_o.copy_(o_proj)
        return self

    def hf_weights(self) -> dict:
        hd, nq, nkv = self.head_dim, self.n_heads, self.n_kv_heads
        q, k, v = self.w_qkv.detach().split([nq * hd, nkv * hd, nkv * hd])
        return {"input_layernorm.weight": self.gamma.detach(),
                "self_attn.q_proj.weight": interleaved_to_rotate_half(q, hd),
                "self_attn.k_proj.weight": interleaved_to_rotate_half(k, hd),
                "self_attn.v_proj.weight": v, "self_attn.o_proj.weight": self.w_o.detach()}


class LlamaBlock(nn.Module):
    """A pre-norm Llama decoder block: attention then MLP, each with its residual; the residual
    GEMMs hand each norm its statistics.  ``forward(h, sumsq=None) -> (h_out, sumsq_out)``."""

    def __init__(self, d: int, n_heads: int, ffn: int, n_kv_heads: int | None = None, eps: float = 1e-6,
                 dtype=torch.bfloat16, device=None, **attention):
        super().__init__()
        self.attention = LlamaAttention(d, n_heads, n_kv_heads, eps=eps, dtype=dtype, device=device, **attention)
        self.mlp = LlamaMLP(d, ffn, eps=eps, dtype=dtype, device=device)

    def forward(self, h: torch.Tensor, sumsq: torch.Tensor | None = None):
        # the O projection's epilogue also scales h by the MLP norm's gamma: the MLP's first GEMM
        # reads that, so no pass folds gamma into its input or weight
        h, sumsq, scaled = self.attention._forward(h, sumsq, self.mlp.gamma)
        return self.mlp._forward(h, sumsq, scaled)

    def load_hf(self, layer: dict) -> "LlamaBlock":
        """From a Hugging Face Llama decoder layer's state dict (keys without the layer prefix)."""
        self.attention.load_hf(layer["input_layernorm.weight"], layer["self_attn.q_proj.weight"],
                               layer["self_attn.k_proj.weight"], layer["self_attn.v_proj.weight"],
                               layer["self_attn.o_proj.weight"])
        self.mlp.load_hf(layer["post_attention_layernorm.weight"], layer["mlp.gate_proj.weight"],
                         layer["mlp.up_proj.weight"], layer["mlp.down_proj.weight"])
        return self

    def hf_weights(self) -> dict:
        return {**self.attention.hf_weights(), **self.mlp.hf_weights()}


_NOTHING_ELSE = (None,) * 6  # no gradient for target, ignore_index, reduction, save_logits, token_chunk, grad_enabled


class _LinearCrossEntropy(torch.autograd.Function):
    """Three ways through the head, one per memory mode (see linear_cross_entropy):
    "saved": the logits stored, turned into their gradient in backward;
    "now": lean, the gradients made in the forward per token chunk for a unit upstream
    gradient, scaled in backward (mean and sum: the upstream gradient is one number);
    "later": lean, statistics only, the logits recomputed per token chunk in backward with
    their gradient in the epilogue (reduction "none", whose upstream gradient is per row)."""

    @staticmethod
    def forward(ctx, h, weight, target, ignore_index, reduction, save_logits, token_chunk, grad_enabled):
        h2, t = h.reshape(-1, h.shape[-1]), target.reshape(-1)
        valid = t != ignore_index
        torch._assert_async(((t >= 0) & (t < weight.shape[0]) | ~valid).all(),
                            "linear_cross_entropy: a target is outside [0, vocab) and not ignore_index")
        # int32 class indices, compared with the column index exactly at any vocabulary; -1 matches no column
        t_index = torch.where(valid, t, -1).to(torch.int32)
        count = valid.sum()
        ctx.reduction, ctx.shape = reduction, (h.shape, target.shape)
        # needs_input_grad says what requires a gradient, even under no_grad, where none will come
        need_dh, need_dw = (grad_enabled and need for need in ctx.needs_input_grad[:2])
        if save_logits:
            ctx.mode = "saved"
            shift = one_pass(exp_shift, h2)(h2, weight, t_index)
            exps, sumexp, target_logit = _OPS["cross_entropy_exp_save"](h2, weight, shift, t_index)
            per_row = torch.where(valid, shift + torch.log(sumexp) - target_logit, 0.0)
            ctx.save_for_backward(h2, weight, t_index, sumexp, valid, count, exps)
        elif reduction == "none" or not (need_dh or need_dw):
            ctx.mode, ctx.token_chunk = "later", token_chunk
            lse, target_logit = _OPS["cross_entropy_stats"](h2, weight, t_index)
            per_row = torch.where(valid, lse - target_logit, 0.0)
            ctx.save_for_backward(h2, weight, t_index, lse, valid, count)
        else:
            ctx.mode = "now"
            unit = valid / count.clamp_min(1) if reduction == "mean" else valid.float()  # d loss / d row loss
            per_row = torch.empty(t.shape, dtype=torch.float32, device=t.device)

            def d_logits(rows):  # the chunk's logits GEMM, its loss rows, its logits made their gradient
                logits, lse, target_logit = _OPS["cross_entropy_stats_save"](h2[rows], weight, t_index[rows])
                per_row[rows] = torch.where(valid[rows], lse - target_logit, 0.0)
                return one_pass(cross_entropy_grad, logits)(logits, lse, t_index[rows], unit[rows], out=logits)

            dh, dw = _head_gradients(h2, weight, token_chunk, d_logits, need_dh, need_dw)
            ctx.save_for_backward(dh, dw)
        if reduction == "none":
            return per_row.reshape(target.shape)
        return per_row.sum() if reduction == "sum" else per_row.sum() / count.clamp_min(1)

    @staticmethod
    def backward(ctx, dloss):
        if ctx.mode == "now":  # made for a unit upstream gradient: scaled in place, no host sync
            dh, dw = ctx.saved_tensors
            one_pass(_scale_in_place, dloss)(dh, dw, dloss)
            return None if dh is None else dh.reshape(ctx.shape[0]), dw, *_NOTHING_ELSE
        # row_stat: the log-sum-exp ("later") or the sum of the stored exponentials ("saved")
        h2, weight, t_index, row_stat, valid, count, *stored = ctx.saved_tensors
        if ctx.reduction == "none":
            per_row = dloss.reshape(-1).float()
        else:
            per_row = dloss.float().expand(valid.shape) / (count.clamp_min(1) if ctx.reduction == "mean" else 1)
        per_row = torch.where(valid, per_row, 0.0)
        if ctx.mode == "later":
            def d_logits(rows):  # the logits GEMM again, with their gradient in its epilogue
                return _OPS["cross_entropy_bwd"](h2[rows], weight, row_stat[rows], t_index[rows], per_row[rows])

            dh, dw = _head_gradients(h2, weight, ctx.token_chunk, d_logits, *ctx.needs_input_grad[:2])
            return None if dh is None else dh.reshape(ctx.shape[0]), dw, *_NOTHING_ELSE
        # d logits = (exps - onehot * sumexp) * scale per row: the target's entries made so in
        # place (one per row), the row scale taken by dW's other operand and by dh's output
        exps, sumexp = stored[0], row_stat
        scale = torch.where(valid, per_row / sumexp, 0.0)
        one_pass(subtract_at_target, exps)(exps, t_index, sumexp)
        need_dh, need_dw = ctx.needs_input_grad[:2]
        # one tokens x d buffer beside dW, as torch's backward holds: h scaled per row for dW,
        # then dh written over it (plain GEMMs: cuBLAS, module docstring)
        rows = one_pass(scale_rows, h2)(h2, scale) if need_dw else None
        dw = exps.t() @ rows if need_dw else None
        dh = None
        if need_dh:
            dh = exps @ weight if rows is None else torch.matmul(exps, weight, out=rows)
            dh = one_pass(scale_rows, dh)(dh, scale, out=dh).reshape(ctx.shape[0])
        return dh, dw, *_NOTHING_ELSE


def _scale_in_place(dh: torch.Tensor | None, dw: torch.Tensor | None, dloss: torch.Tensor) -> None:
    """dh and dW times the upstream gradient (a number on the device), in fp32, over their own
    memory.  Compiled (`one_pass`): torch's own ``mul_`` by a 0-d device tensor broadcasts it and
    runs unvectorized, 2.4 ms over the 1 GiB dW of vocab 128256 x 4096 on an H100."""
    for g in (dh, dw):
        if g is not None:
            g.copy_(g.float() * dloss)


#: the most bytes of logits (or their gradient) that linear_cross_entropy(save_logits=False)
#: holds at once, which sets its default token chunk: 768 tokens at vocab 128256 in bf16
LEAN_CHUNK_BYTES = 192 * 2 ** 20


def lean_token_chunk(vocab: int, dtype: torch.dtype) -> int:
    """The default token chunk of linear_cross_entropy(save_logits=False): as many tokens as
    LEAN_CHUNK_BYTES of logits hold, a multiple of 128 (a tile's rows), at least 128."""
    fits = LEAN_CHUNK_BYTES // (vocab * dtype.itemsize)
    return max(128, fits // 128 * 128)


def _head_gradients(h, weight, chunk, d_logits, need_dh, need_dw):
    """dh and dW of the LM head one chunk of ``chunk`` tokens at a time: ``d_logits(rows)`` gives
    the chunk's (tokens, vocab) logits gradient; its dh rows come from one GEMM over the whole
    vocabulary (written once, no sum), and dW sums the chunks' products in the weight's dtype
    (cuBLAS addmm, fp32 inside each product, one rounding per chunk).  Extra memory: one chunk's
    logits gradient, released before the next chunk's is made."""
    dh = torch.empty_like(h) if need_dh else None
    dw = torch.empty_like(weight) if need_dw else None
    for start in range(0, h.shape[0], chunk):
        rows = slice(start, start + chunk)
        grad = d_logits(rows)
        if dh is not None:
            torch.matmul(grad, weight, out=dh[rows])  # plain GEMMs: cuBLAS (module docstring)
        if dw is not None and start == 0:
            torch.matmul(grad.t(), h[rows], out=dw)
        elif dw is not None:
            dw.addmm_(grad.t(), h[rows])
        del grad  # before the next chunk's logits exist
    return dh, dw


#: what linear_cross_entropy's default mode adds to a row's target logit to anchor the row's
#: stored exponentials exp(logit - shift) (`cross_entropy_exp_save`): the target's own is e^-60,
#: a logit up to 88 nats above the target's (a per-token loss up to ~148 nats) stays under the
#: 16-bit floats' largest exponent (e^88.7), and those that flush to zero (below e^-87) lie more
#: than 27 nats under the target's logit, where each weighs under 2e-12 of the target's probability
EXP_SHIFT = 60.0


def exp_shift(h: torch.Tensor, weight: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The anchor of each row's stored exponentials: its target's logit h . weight[target] (fp32)
    plus EXP_SHIFT, and +inf for a row without a target (index -1), whose exponentials are then
    all 0.  One pass over h and the target rows of the weight (`one_pass`)."""
    rows = weight[target.clamp_min(0).long()]
    logit = (h.float() * rows.float()).sum(-1)
    return torch.where(target >= 0, logit + EXP_SHIFT, float("inf"))


def subtract_at_target(exps: torch.Tensor, target: torch.Tensor, sumexp: torch.Tensor) -> None:
    """exps[t, target[t]] -= sumexp[t] in place (rows without a target, index -1, untouched):
    with it a row of stored exponentials times dloss / sumexp is the row's logit gradient
    (softmax - onehot) * dloss."""
    rows = torch.arange(exps.shape[0], device=exps.device)
    cols = target.clamp_min(0).long()
    at = exps[rows, cols].float()
    exps[rows, cols] = torch.where(target >= 0, at - sumexp, at).to(exps.dtype)


def scale_rows(t: torch.Tensor, scale: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """t times a per-row fp32 scale, in t's dtype (fp32 products, rounded once); ``out=t`` in place."""
    scaled = t.float() * scale[:, None]
    return scaled.to(t.dtype) if out is None else out.copy_(scaled)


def cross_entropy_grad(logits: torch.Tensor, lse: torch.Tensor, target: torch.Tensor, dloss: torch.Tensor,
                       *, out: torch.Tensor | None = None) -> torch.Tensor:
    """d logits of cross-entropy from stored logits, the math of the `cross_entropy_bwd` epilogue:
    (exp(logits - lse) - onehot(target)) * dloss per row, in the logits' dtype.  ``target`` is the
    class index (int32, -1: none; a float target is compared as a float), ``lse`` and ``dloss`` are
    fp32 per row.  ``out=logits`` writes the gradient over the logits (torch.compile keeps that one
    pass, in place)."""
    prob = torch.exp(logits.float() - lse[:, None])
    cols = torch.arange(logits.shape[1], device=logits.device, dtype=target.dtype)
    grad = torch.where(cols == target[:, None], prob - 1.0, prob) * dloss[:, None]
    return grad.to(logits.dtype) if out is None else out.copy_(grad)


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                         ignore_index: int = -100, reduction: str = "mean", save_logits: bool = True,
                         token_chunk: int | None = None) -> torch.Tensor:
    """``F.cross_entropy(h @ weight.T, target)`` with the cross-entropy in the logits GEMM's epilogue.

    Forward (``save_logits=True``, the default): one pass gives each row's anchor, its target's
    logit plus ``EXP_SHIFT`` = 60 (`exp_shift`); then one GEMM whose epilogue stores, instead of
    each logit, exp(logit - anchor) and keeps per-row partials of their sum and of the target's
    logit (`cross_entropy_exp_save`; tokens x vocab values in the input dtype, 2.1 GB for 8192
    tokens at vocab 128256, held until the backward, as torch's own cross-entropy holds the
    logits); lse = anchor + log(sum).  Backward: d logits = (stored - onehot * sum) * dloss / sum
    per row, so no pass over the stored values: the target's entry of each row is lowered by the
    row's sum in place (one value per row), dh is the plain GEMM of the stored values and the
    weight with its rows scaled after, and dW the plain GEMM of the stored values and h scaled
    per row.  Because the backward changes the stored values in place, it runs once: a second
    backward through the same graph (retain_graph=True) raises PyTorch's error about a saved
    tensor modified in place.  Range: the anchor keeps every stored value finite while no logit
    exceeds its row's target logit by more than ~88 nats (a per-token loss under ~148 nats);
    beyond, that row's loss comes out inf and the gradients inf or NaN, never quietly wrong (the
    lean mode has no such bound).  Stored exponentials are also more precise than stored 16-bit
    logits, whose rounding (2^-9 of the logit) moves exp(logit - lse) by 2^-9 times the logit.

    ``save_logits=False`` is the memory-lean mode: the tokens x vocab logits never exist, only
    one chunk of ``token_chunk`` tokens' logits at a time (rounded up to a multiple of 8;
    default `lean_token_chunk`: what LEAN_CHUNK_BYTES = 192 MiB holds, 768 tokens at vocab
    128256 in bf16), so the memory it adds grows with the chunk, not with tokens x vocab.
    With reduction "mean" or "sum" the forward makes the gradients too, chunk by chunk, as if
    the loss's upstream gradient were 1: the chunk's logits GEMM with the statistics in its
    epilogue (`cross_entropy_stats_save`), one compiled pass turning those logits into their
    gradient in place, their share of dh (one GEMM over the whole vocabulary) and of dW (summed
    over the chunks in the weight's dtype, one rounding per chunk, as Liger-Kernel's fused
    linear cross-entropy does); the backward only scales dh and dW by the upstream gradient, in
    place, so it too runs once per forward.  Those are the three GEMMs of the default mode,
    done in the forward: a forward whose loss never reaches ``backward`` (with gradients
    enabled) pays for them anyway; under ``torch.no_grad()`` only the statistics are made.
    With reduction "none" (a gradient per row) the forward keeps the statistics alone
    (`cross_entropy_stats`) and the backward runs the logits GEMM again per chunk with the
    gradient in its epilogue (`cross_entropy_bwd`): four GEMMs.

    ``h`` is (..., d), ``weight`` (vocab, d), ``target`` integer class indices of h's leading
    shape; ``reduction`` is "mean" (over non-ignored targets), "sum" or "none".  On the GPU the
    vocabulary and d must be multiples of 8 (TMA rows of 16 bytes).
    """
    if reduction not in ("mean", "sum", "none"):
        raise ArgumentError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if not isinstance(save_logits, bool):
        raise ArgumentError(f"save_logits must be True or False, got {save_logits!r}")
    if token_chunk is not None and (type(token_chunk) is not int or token_chunk < 1):
        raise ArgumentError(f"token_chunk must be a positive int (tokens per chunk) or None, got {token_chunk!r}")
    if token_chunk is not None and save_logits:
        raise ArgumentError("token_chunk sets the memory-lean mode's chunk: pass it with save_logits=False")
    if type(ignore_index) is not int:
        raise ArgumentError(f"ignore_index must be an int, got {ignore_index!r}")
    for name, value in (("h", h), ("weight", weight), ("target", target)):
        if not isinstance(value, torch.Tensor):
            raise ArgumentError(f"{name} must be a tensor, got {type(value).__name__}")
    if h.dim() < 2 or h.numel() == 0:
        raise ArgumentError(f"h must be a non-empty tensor of shape (..., d), got {tuple(h.shape)}")
    if h.dtype != weight.dtype or h.device != weight.device or not h.dtype.is_floating_point:
        raise ArgumentError(f"h and weight must share a float dtype and a device, got {h.dtype} on {h.device} "
                            f"and {weight.dtype} on {weight.device}")
    if (target.shape != h.shape[:-1] or target.dtype.is_floating_point or target.dtype == torch.bool
            or target.device != h.device):
        raise ArgumentError(f"target must be integer class indices of shape {tuple(h.shape[:-1])} (h's leading "
                            f"dims) on {h.device}, got {target.dtype} {tuple(target.shape)} on {target.device}")
    if weight.dim() != 2 or weight.shape[1] != h.shape[-1] or weight.shape[0] == 0:
        raise ArgumentError(f"weight must be (vocab, {h.shape[-1]}) for h of width {h.shape[-1]}, "
                            f"got {tuple(weight.shape)}")
    if h.is_cuda and weight.shape[0] % 8:  # d logits (or the saved logits) rows are stored with TMA
        raise ArgumentError(f"linear_cross_entropy on the GPU needs a vocabulary that is a multiple of 8, got "
                            f"{weight.shape[0]} (pad the head with rows whose targets never occur)")
    if not target.is_cuda and not torch.compiler.is_compiling():  # on the GPU: an assert in the forward
        wrong = ((target < 0) | (target >= weight.shape[0])) & (target != ignore_index)
        if wrong.any():
            raise ArgumentError(f"target holds {target[wrong][0].item()}, outside [0, {weight.shape[0]}) and not "
                                f"ignore_index ({ignore_index})")
    # chunks start at multiples of 8 tokens: each chunk's per-token vectors (targets, statistics)
    # stay 16-byte aligned, as the kernels' vector loads need
    chunk = -(-token_chunk // 8) * 8 if token_chunk else lean_token_chunk(weight.shape[0], weight.dtype)
    return _LinearCrossEntropy.apply(h, weight, target, ignore_index, reduction, save_logits, chunk,
                                     torch.is_grad_enabled())


class EpilogueChain(nn.Module):
    """Layers of your own programs, ``y_i = program_i(y_{i-1} @ W_i.T, operands_i)``, with the
    weights as parameters, trained with derived backwards (``ops.trainable_chain``: each layer's
    backward in the next layer's dgrad epilogue).

    ``features``: each layer's GEMM output columns N_i; a layer's input width is the previous
    layer's passed output (its first tile output: N/2 wide for a GLU).  The weights start as
    ``randn / sqrt(fan_in)``.  Operands are given per call, one dict per layer; ``outputs``: the
    last layer's outputs whose gradient flows back (see ``trainable_chain``).
    """

    def __init__(self, programs, in_features: int, features, *, outputs=None, device=None, dtype=torch.bfloat16):
        super().__init__()
        programs, features = list(programs), list(features)
        if len(programs) != len(features):
            raise ArgumentError(f"EpilogueChain: {len(programs)} programs but {len(features)} feature counts")
        self.chain = trainable_chain(programs, outputs=outputs)
        self.weights = nn.ParameterList()
        width = in_features
        for layer, n in zip(self.chain.layers, features):
            passed = layer.program.tile_outputs[0].node.width * n
            if passed.denominator != 1:
                raise ArgumentError(f"EpilogueChain: {layer.program.name} passes on {passed} columns of {n}: "
                                    "choose an even feature count")
            weight = torch.randn(n, width, device=device, dtype=torch.float32) / width ** 0.5
            self.weights.append(nn.Parameter(weight.to(dtype)))
            width = int(passed)
        self.out_features = width

    def forward(self, x: torch.Tensor, operands=None):
        return self.chain(x, list(self.weights), operands)


def rms_norm_reference(h, gamma, eps):
    """Hugging Face's LlamaRMSNorm: statistics in fp32, the normalized input back in h's dtype."""
    hf = h.float()
    return gamma * (hf * torch.rsqrt(hf.square().mean(-1, keepdim=True) + eps)).to(h.dtype)


def llama_attention_reference(h, gamma, wq, wk, wv, wo, n_heads, n_kv_heads, head_dim, cos, sin, eps):
    """Hugging Face-style attention half (rotate-half RoPE on unpermuted weights) in plain PyTorch."""
    batch, seq, _ = h.shape
    x = rms_norm_reference(h, gamma, eps)
    q, k, v = ((x @ w.t()).reshape(batch, seq, -1, head_dim).transpose(1, 2) for w in (wq, wk, wv))
    cos_full = torch.cat([cos[:seq], cos[:seq]], -1).to(q.dtype)  # tables in the activations' dtype, as HF does
    sin_full = torch.cat([sin[:seq], sin[:seq]], -1).to(q.dtype)

    def rotate(t):
        half = t.shape[-1] // 2
        return t * cos_full + torch.cat([-t[..., half:], t[..., :half]], -1) * sin_full

    attn = torch.nn.functional.scaled_dot_product_attention(rotate(q), rotate(k), v, is_causal=True,
                                                            enable_gqa=n_heads != n_kv_heads)
    return h + attn.transpose(1, 2).reshape(batch, seq, -1) @ wo.t()


def llama_mlp_reference(h, gamma, w_gate, w_up, w_down, eps):
    """The unfused block in plain PyTorch (what LlamaMLP must match, forward and backward)."""
    x = rms_norm_reference(h, gamma, eps)
    a = torch.nn.functional.silu(x @ w_gate.t()) * (x @ w_up.t())
    return h + a @ w_down.t()

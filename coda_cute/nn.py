"""Transformer blocks as GEMM + epilogue programs, autograd-aware.

``LlamaMLP`` is the pre-norm SwiGLU MLP of a Llama block with its residual:

    h_out = h + W_down @ (silu(gate) * up),   (gate, up) = W_gate_up @ (rmsnorm(h) * gamma)

rewritten as two GEMMs whose epilogues do everything else (CODA):

forward
  1. rstd = rsqrt(sumsq / d + eps) per row, from the `sumsq` the previous block's
     residual GEMM produced (for the first block: one small torch reduction over h);
  2. W_f = W_gate_up * gamma (gamma folded along K; refolded every call, so it trains);
  3. `rms_swiglu_save`: z = rstd * (h @ W_f.T), a = silu(gate) * up; z is saved;
  4. `residual_sumsq`: h_out = h + a @ W_down.T, plus sum(h_out^2) per row for the next norm.
backward (dh_out)
  5. `swiglu_bwd_recompute`: dz = SwiGLU'(z) * (dh_out @ W_down), and a recomputed (not saved);
  6. dW_down = dh_out.T @ a (plain GEMM on transposed views);
  7. `rmsnorm_bwd`: dx_hat * rstd, row dots and dgamma partials in the dgrad dz @ W_gate_up;
  8. dW_gate_up = dz.T @ x with x = h * rstd * gamma recomputed (an elementwise pass; the
     normalized input is not saved), and dh = dh_out + D - h * rstd^2 * rowdot / d (elementwise).

On CPU tensors every program runs in the reference interpreter, so the module also
works (slowly) without a GPU.  The gate/up weight holds gate and up rows interleaved:
``interleave_gate_up`` / ``split_gate_up`` convert from and to the usual two matrices.
"""

from __future__ import annotations

import torch
from torch import nn

from . import library
from .errors import ArgumentError
from .ops import library_op


def interleave_gate_up(w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    """(F, d) gate and up projections -> one (2F, d) weight with rows gate_0, up_0, gate_1, ..."""
    if w_gate.shape != w_up.shape:
        raise ValueError(f"gate {tuple(w_gate.shape)} and up {tuple(w_up.shape)} projections must have one shape")
    return torch.stack([w_gate, w_up], dim=1).reshape(2 * w_gate.shape[0], w_gate.shape[1])


def split_gate_up(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of ``interleave_gate_up``."""
    return w[0::2], w[1::2]


# registered at import, so torch.compile traces straight to the ops (no file access while tracing)
_OPS = {name: library_op(library.get(name))
        for name in ("rms_swiglu_save", "residual_sumsq", "swiglu_bwd_recompute", "rmsnorm_bwd", "gemm")}


class _LlamaMLPFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, sumsq, gamma, w_gate_up, w_down, eps):
        ops = _OPS
        d = h.shape[-1]
        h2 = h.reshape(-1, d)
        if sumsq is None:
            sumsq = h2.float().square().sum(-1)
        rstd = torch.rsqrt(sumsq.reshape(-1) / d + eps)
        w_folded = (w_gate_up.float() * gamma.float()).to(w_gate_up.dtype)
        a, z = ops["rms_swiglu_save"](h2, w_folded, rstd)
        h_out, sumsq_out = ops["residual_sumsq"](a, w_down, h2)
        ctx.save_for_backward(h2, rstd, z, gamma, w_gate_up, w_down)
        ctx.shape = h.shape
        ctx.mark_non_differentiable(sumsq_out)
        return h_out.reshape(h.shape), sumsq_out.reshape(h.shape[:-1])

    @staticmethod
    def backward(ctx, dh_out, _dsumsq):
        ops = _OPS
        h, rstd, z, gamma, w_gate_up, w_down = ctx.saved_tensors
        d = h.shape[-1]
        dy = dh_out.reshape(-1, d).to(h.dtype).contiguous()
        dz, a = ops["swiglu_bwd_recompute"](dy, w_down.t(), z)
        dw_down = ops["gemm"](dy.t(), a.t())
        dx_scaled, rowdot, dgamma = ops["rmsnorm_bwd"](dz, w_gate_up.t(), h, rstd, gamma)
        x = (h.float() * rstd[:, None] * gamma.float()).to(h.dtype)
        dw_gate_up = ops["gemm"](dz.t(), x.t())
        correction = (rstd * rstd * rowdot / d)[:, None]
        dh = dy.float() + dx_scaled.float() - h.float() * correction
        return (dh.to(dh_out.dtype).reshape(ctx.shape), None, dgamma.to(gamma.dtype), dw_gate_up, dw_down, None)


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
        tokens = h.numel() // h.shape[-1]
        if h.is_cuda and tokens % 8:
            raise ArgumentError(
                f"LlamaMLP on the GPU needs the number of tokens (all dims of h but the last) to be a multiple "
                f"of 8, got {tokens}: the weight-gradient GEMMs reduce over tokens and TMA needs 16-byte rows"
            )
        return _LlamaMLPFunction.apply(h, sumsq, self.gamma, self.w_gate_up, self.w_down, self.eps)

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


def llama_mlp_reference(h, gamma, w_gate, w_up, w_down, eps):
    """The unfused block in plain PyTorch (what LlamaMLP must match, forward and backward)."""
    x = h * torch.rsqrt(h.square().mean(-1, keepdim=True) + eps) * gamma
    a = torch.nn.functional.silu(x @ w_gate.t()) * (x @ w_up.t())
    return h + a @ w_down.t()

"""RMSNorm rewritten around GEMMs (CODA).

Forward: the residual-add GEMM emits per-row sum-of-squares partials; the next GEMM
(its weight pre-multiplied by gamma along K) applies 1/rms per row in its epilogue.
Backward: the dgrad GEMM of the normalized input emits the per-row dot and the
per-column dgamma as partials.
"""

import coda_cute as cc


@cc.epilogue
def residual_sumsq(acc, residual: cc.Tile):
    """h = residual + A @ B.T (rounded to the stream dtype); also sum(h^2) per row, as partials."""
    h = (acc + residual).to(cc.input_dtype)
    return {"D": h, "sumsq": cc.row_sumsq(h)}


@cc.epilogue
def residual_sumsq_scaled(acc, residual: cc.Tile, gamma: cc.ColVec):
    """residual_sumsq, and h * gamma: the next RMSNorm's scale applied to the next GEMM's input
    here, where h passes anyway, so no separate pass scales it (the norm's rstd goes into that
    GEMM's epilogue)."""
    h = (acc + residual).to(cc.input_dtype)
    return {"D": h, "sumsq": cc.row_sumsq(h), "scaled": (h * gamma).to(cc.input_dtype)}


@cc.epilogue
def rms_scale(acc, rstd: cc.RowVec):
    """D = rstd[row] * (A @ (W * gamma).T): RMSNorm applied after the GEMM, gamma folded into W."""
    return acc * rstd


@cc.epilogue
def rms_scale_gamma(acc, rstd: cc.RowVec, gamma: cc.ColVec):
    """D = rstd[row] * gamma[col] * (A @ B.T): a row scale and a column scale on one output."""
    return acc * rstd * gamma


@cc.epilogue
def rmsnorm_bwd(acc, x: cc.Tile, rstd: cc.RowVec, gamma: cc.ColVec):
    """RMSNorm backward statistics in the dgrad epilogue.

    acc = dy, the gradient of the norm's output y = x * rstd * gamma (dgrad of the next GEMM).
    D = dx_hat * rstd with dx_hat = dy * gamma; rowdot = sum(dx_hat * x_hat) per row;
    dgamma = sum(dy * x_hat) per column, with x_hat = x * rstd.  Then
    dx = D - x_hat * rstd * rowdot / N (a small elementwise finish).
    """
    x_hat = x * rstd
    dx_hat = acc * gamma
    return {
        "D": dx_hat * rstd,
        "rowdot": cc.row_sum(dx_hat * x_hat),
        "dgamma": cc.col_sum(acc * x_hat),
    }


@cc.epilogue
def rmsnorm_bwd_residual(acc, x: cc.Tile, rstd: cc.RowVec, gamma: cc.ColVec, dresidual: cc.Tile):
    """rmsnorm_bwd plus the residual stream's gradient and the weight gradient's normalized input.

    For a pre-norm block, where x is also the residual stream:
    D = dx_hat * rstd + dresidual (the residual branch's gradient joins in the epilogue);
    x_norm = x_hat * gamma, the normalized input of the weight gradient (stored, not recomputed);
    rowdot and dgamma as in rmsnorm_bwd.  Then dx = D - x_hat * rstd * rowdot / N.
    """
    x_hat = x * rstd
    dx_hat = acc * gamma
    return {
        "D": dx_hat * rstd + dresidual,
        "x_norm": x_hat * gamma,
        "rowdot": cc.row_sum(dx_hat * x_hat),
        "dgamma": cc.col_sum(acc * x_hat),
    }


@cc.epilogue
def rmsnorm_bwd_rowdot(acc, x: cc.Tile, rstd: cc.RowVec, gamma: cc.ColVec, dresidual: cc.Tile,
                       rowdot: cc.RowVec, inv_n: cc.Scalar):
    """rmsnorm_bwd_residual with the row dot given, so D is the whole gradient of x.

    rowdot = sum(dx_hat * x_hat) per row, taken before this GEMM (e.g. by swiglu_bwd_recompute,
    as sum(dz * z) over the next GEMM's output); inv_n = 1 / N.
    D = (dx_hat - x_hat * rowdot * inv_n) * rstd + dresidual; dgamma as in rmsnorm_bwd.  No pass
    after the GEMM.  The weight gradient's input x_hat * gamma is not stored here: made before
    this GEMM and released after the weight gradient, it is never live beside D (the backward's
    peak memory; nn.LlamaMLP).
    """
    x_hat = x * rstd
    return {
        "D": (acc * gamma - x_hat * (rowdot * inv_n)) * rstd + dresidual,
        "dgamma": cc.col_sum(acc * x_hat),
    }


@cc.epilogue
def qk_rmsnorm(acc, gamma: cc.ColVec, *, head_dim=128, eps=1e-6):
    """Per-head RMSNorm of a q or k projection (QK-norm): a per-row reduction over each head."""
    ms = cc.row_sumsq(acc, segment=head_dim) / head_dim
    return acc * cc.rsqrt(ms + eps) * gamma

"""Rotary position embedding in the QKV GEMM's epilogue.

Convention: interleaved pairs (2i, 2i+1) within each head.  For the rotate-half
(Llama / Hugging Face) convention, permute the q/k weight rows into interleaved order
once; the epilogue is then the same.  cos/sin are tables (positions, head_dim/2), read
as T[row % positions, pair % (head_dim/2)].
"""

import coda_cute as cc


@cc.epilogue
def rope_qkv(acc, cos: cc.Table["N/2"], sin: cc.Table["N/2"], *, rotary_cols=5120):
    """Rotate the first ``rotary_cols`` columns (q and k heads); pass the rest (v) through."""
    x0, x1 = cc.pairs(acc)
    rotate = x0.col < rotary_cols // 2
    y0 = cc.where(rotate, x0 * cos - x1 * sin, x0)
    y1 = cc.where(rotate, x0 * sin + x1 * cos, x1)
    return cc.interleave(y0, y1)


@cc.epilogue
def rms_rope_qkv(acc, rstd: cc.RowVec, cos: cc.Table["N/2"], sin: cc.Table["N/2"], *, rotary_cols=5120):
    """RMSNorm'd QKV GEMM + RoPE: z = rstd[row] * (h @ (W * gamma).T), then rope_qkv on z."""
    z = acc * rstd
    x0, x1 = cc.pairs(z)
    rotate = x0.col < rotary_cols // 2
    y0 = cc.where(rotate, x0 * cos - x1 * sin, x0)
    y1 = cc.where(rotate, x0 * sin + x1 * cos, x1)
    return cc.interleave(y0, y1)

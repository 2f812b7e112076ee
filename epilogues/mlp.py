"""SwiGLU MLP: gate/up GEMM with the activation fused, and its backward.

The gate/up weight is stored with gate and up rows interleaved (row 2j = gate_j,
row 2j+1 = up_j), so each thread of the GEMM holds a (gate, up) column pair.
"""

import coda_cute as cc


@cc.epilogue
def swiglu(acc):
    """D = silu(gate) * up over interleaved columns; N/2 wide."""
    gate, up = cc.pairs(acc)
    return cc.silu(gate) * up


@cc.epilogue
def swiglu_save(acc):
    """As swiglu, and also store the pre-activation (gate, up) for the backward pass."""
    gate, up = cc.pairs(acc)
    return {"D": cc.silu(gate) * up, "preact": acc}


@cc.epilogue
def swiglu_bwd(acc, preact: cc.Tile["2N"]):
    """Down-projection dgrad + SwiGLU backward.

    acc = dh (M x F), preact = saved interleaved (gate, up) (M x 2F).
    D = interleaved (dgate, dup), 2N wide: the gradient of the pre-activation.
    """
    gate, up = cc.pairs(preact)
    sig = cc.sigmoid(gate)
    dgate = acc * up * sig * (1.0 + gate * (1.0 - sig))
    dup = acc * gate * sig
    return cc.interleave(dgate, dup)


@cc.epilogue
def swiglu_bwd_recompute(acc, preact: cc.Tile["2N"]):
    """As swiglu_bwd, and also recompute h = silu(gate) * up (N wide) for the down-projection wgrad.

    rowdot = sum(D * preact) per row: for a pre-activation z = y @ W.T of a normalized input y,
    the dot sum(dy * y) that the norm's backward needs (sum(dz * z) = sum(dy * y) with dy = dz @ W),
    taken here, where the whole row passes anyway, so the dgrad after it can finish the norm's
    gradient in its epilogue (`rmsnorm_bwd_rowdot`)."""
    gate, up = cc.pairs(preact)
    sig = cc.sigmoid(gate)
    silu_gate = gate * sig
    dgate = acc * up * sig * (1.0 + gate * (1.0 - sig))
    dup = acc * silu_gate
    return {"D": cc.interleave(dgate, dup), "h": silu_gate * up, "rowdot": cc.row_sum(dgate * gate + dup * up)}


@cc.epilogue
def rms_swiglu_save(acc, rstd: cc.RowVec):
    """RMSNorm'd gate/up GEMM + SwiGLU: z = rstd[row] * (h @ (W * gamma).T), D = silu(gate) * up.

    The norm's gain gamma is folded into the weight along K; its per-row scale is applied
    here. The pre-activation z (interleaved gate, up) is also stored for the backward pass.
    """
    z = acc * rstd
    gate, up = cc.pairs(z)
    return {"D": cc.silu(gate) * up, "preact": z}

"""Plain GEMM and the classic single-GEMM epilogues."""

import coda_cute as cc


@cc.epilogue
def gemm(acc):
    """D = A @ B.T, stored in the inputs' dtype."""
    return acc


@cc.epilogue
def bias_gelu(acc, bias: cc.ColVec):
    """D = gelu(A @ B.T + bias), exact (erf) GELU."""
    return cc.gelu(acc + bias)


@cc.epilogue
def alpha_beta(acc, c: cc.Tile, alpha: cc.Scalar, beta: cc.Scalar):
    """D = alpha * (A @ B.T) + beta * C: BLAS-style accumulation (e.g. gradient accumulation)."""
    return alpha * acc + beta * c


@cc.epilogue
def gemm_accumulate(acc, c: cc.Tile):
    """D = A @ B.T + C in fp32: sums GEMMs into one fp32 buffer (in place with out={"D": c}),
    e.g. a product over chunks of K summed without rounding between the chunks."""
    return (acc + c).to(cc.f32)

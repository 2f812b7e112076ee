"""The reference interpreter against hand-written PyTorch, primitive by primitive and for the library.

Expected values are written out here in float64 from the raw inputs (``gemm64``), so a
mistake shared by the interpreter and ``torch.nn.functional`` would still show.  Data is
fresh random per test (see the ``gen`` fixture); row and column operands are distinct
random vectors and M != N, so a swapped broadcast cannot pass.

Tolerances (every comparison goes through ``close`` with one of these):

- ``F32``: fp32 results against float64 math.  K <= 24 and values are O(1), so the
  interpreter's fp32 GEMM and math are within ~1e-6 relative; 1e-5 leaves margin.
- ``STORED[dtype]``: a tile stored in bf16 / f16 against the float64 value rounded to the
  same dtype: one unit in the last place (the fp32 and float64 values may round to
  neighbours when they straddle a rounding boundary), i.e. rtol 2**-7 (bf16), 2**-10 (f16).
- ``EXACT``: results that involve no rounding at all (coordinates, selections, copies).
"""

import math

import pytest
import torch

import coda_cute as cc
from coda_cute import library
from coda_cute.reference import finish

F32 = dict(rtol=1e-5, atol=1e-5)
STORED = {
    torch.float32: F32,
    torch.bfloat16: dict(rtol=2**-7, atol=1e-5),
    torch.float16: dict(rtol=2**-10, atol=1e-5),
}
EXACT = dict(rtol=0.0, atol=0.0)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = ["f32", "bf16", "f16"]

# Problem sizes: M = 2 * 7 = 14 rows (batch dims on A), N = 20, K = 24; partial tiles of
# 8 x 8 so that neither M nor N (nor N/2, 2N) is a multiple of the tile.
BATCH, N, K = (2, 7), 20, 24
M = BATCH[0] * BATCH[1]
TILE = (8, 8)


def randn(gen, *shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype)


def nonzero(gen, *shape, dtype=torch.float32):
    """Random values with random sign and magnitude in [0.5, 1.5] (safe divisors)."""
    sign = torch.randint(0, 2, shape, generator=gen) * 2 - 1
    return (sign * (torch.rand(*shape, generator=gen, dtype=torch.float64) + 0.5)).to(dtype)


def problem(gen, dtype=torch.float32, batch=BATCH, n=N, k=K):
    """A (batch..., K) and B (N, K) with O(1) products (A scaled by 1/sqrt(K))."""
    return randn(gen, *batch, k, dtype=dtype, scale=k**-0.5), randn(gen, n, k, dtype=dtype)


def gemm64(a, b):
    """acc = A @ B.T in float64, batch dims flattened: (M, N)."""
    return a.double().reshape(-1, a.shape[-1]) @ b.double().t()


def close(actual, expected, tol):
    torch.testing.assert_close(actual.double(), expected.double(), **tol)


def stored(expected64, dtype):
    """What a float64 result looks like after being stored in ``dtype``."""
    return expected64.to(dtype).double()


def flat(t, cols=None):
    return t.reshape(-1, t.shape[-1] if cols is None else cols)


def trace(fn, **constants):
    return cc.epilogue(fn, name="prog", **constants)


# --------------------------------------------------------------------------- the GEMM itself
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_plain_gemm(gen, dtype):
    a, b = problem(gen, dtype)
    res = cc.evaluate(library.get("gemm"), a, b)
    d = res.outputs["D"]
    assert d.dtype == dtype and d.shape == (*BATCH, N)
    close(flat(d), stored(gemm64(a, b), dtype), STORED[dtype])
    assert res.acc.dtype == torch.float32 and res.acc.shape == (M, N)
    close(res.acc, gemm64(a, b), F32)


def test_two_dimensional_a_has_no_batch_dims(gen):
    a, b = problem(gen, batch=(5,), n=3)
    d = cc.evaluate(library.get("gemm"), a, b).outputs["D"]
    assert d.shape == (5, 3)
    close(d, gemm64(a, b), F32)


# --------------------------------------------------------------------------- elementwise, one op at a time
# The op is applied to the interpreter's own fp32 accumulator (res.acc, checked above), so
# each test isolates the op; comparisons then see the very same values the program saw.
SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
UNARY = {
    "neg": (lambda x: -x, lambda x: -x),
    "abs": (lambda x: abs(x), lambda x: torch.where(x < 0, -x, x)),
    "exp": (cc.exp, lambda x: math.e**x),
    "log": (lambda x: cc.log(abs(x) + 0.5), lambda x: torch.log(x.abs() + 0.5)),
    "sqrt": (lambda x: cc.sqrt(abs(x)), lambda x: x.abs() ** 0.5),
    "rsqrt": (lambda x: cc.rsqrt(abs(x) + 0.25), lambda x: 1.0 / (x.abs() + 0.25) ** 0.5),
    "tanh": (cc.tanh, lambda x: (torch.exp(2 * x) - 1) / (torch.exp(2 * x) + 1)),
    "erf": (cc.erf, lambda x: x.cpu().apply_(math.erf).to(x.device)),  # Python's erf, elementwise
    "sigmoid": (cc.sigmoid, lambda x: 1.0 / (1.0 + torch.exp(-x))),
    "relu": (cc.relu, lambda x: torch.where(x > 0, x, torch.zeros_like(x))),
    "gelu": (cc.gelu, lambda x: 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))),
    "gelu_tanh": (cc.gelu_tanh, lambda x: 0.5 * x * (1.0 + torch.tanh(SQRT_2_OVER_PI * (x + 0.044715 * x**3)))),
    "silu": (cc.silu, lambda x: x / (1.0 + torch.exp(-x))),
    "square": (cc.square, lambda x: x * x),
    "pow2": (lambda x: x**2, lambda x: x * x),
}


@pytest.mark.parametrize("name", list(UNARY))
def test_unary(gen, name):
    f, expected = UNARY[name]
    a, b = problem(gen)
    a = a * 3.0  # spread the inputs over the interesting range of the activations
    res = cc.evaluate(trace(lambda acc: f(acc).to(cc.f32)), a, b)
    x = res.acc.double()
    assert x.min() < -1.0 and x.max() > 1.0
    close(flat(res.outputs["D"]), expected(x), F32)


BINARY = {
    "add": (lambda x, y: x + y, lambda x, y: x + y),
    "sub": (lambda x, y: x - y, lambda x, y: x - y),
    "mul": (lambda x, y: x * y, lambda x, y: x * y),
    "div": (lambda x, y: x / y, lambda x, y: x / y),
    "minimum": (cc.minimum, torch.minimum),
    "maximum": (cc.maximum, torch.maximum),
}


def operands(gen, m=M, n=N, dtype=torch.float32):
    """One operand of every kind, nonzero, as the program receives them."""
    return {"r": nonzero(gen, m, dtype=dtype), "v": nonzero(gen, n, dtype=dtype), "t": nonzero(gen, m, n, dtype=dtype),
            "s": 0.8125, "tab": nonzero(gen, 3, 4, dtype=dtype)}


def expanded(ops, m=M, n=N):
    """The same operands broadcast to (M, N) by hand: r down rows, v along columns, tab[row % 3, col % 4]."""
    rows, cols = torch.arange(m), torch.arange(n)
    tab = ops["tab"].double()
    return {"r": ops["r"].double()[:, None].expand(m, n), "v": ops["v"].double()[None, :].expand(m, n),
            "t": ops["t"].double(), "s": torch.full((m, n), ops["s"], dtype=torch.float64),
            "tab": tab[rows[:, None] % 3, cols[None, :] % 4], "c": torch.full((m, n), 0.7, dtype=torch.float64)}


@pytest.mark.parametrize("name", list(BINARY))
def test_binary_with_every_operand_kind(gen, name):
    f, ref = BINARY[name]

    def prog(acc, r: cc.RowVec, v: cc.ColVec, t: cc.Tile, s: cc.Scalar, tab: cc.Table):
        return {"by_r": f(acc, r), "by_v": f(acc, v), "by_t": f(acc, t), "by_s": f(acc, s), "by_tab": f(acc, tab),
                "by_c": f(acc, 0.7), "rev_v": f(v, abs(acc) + 1.0), "rev_c": f(0.7, abs(acc) + 1.0),
                "rev_s": f(s, abs(acc) + 1.0)}

    a, b = problem(gen)
    ops = operands(gen)
    res = cc.evaluate(trace(prog), a, b, ops)
    x, e = res.acc.double(), expanded(ops)
    for key in ("r", "v", "t", "s", "tab", "c"):
        close(flat(res.outputs["by_" + key]), ref(x, e[key]), F32)
    pos = x.abs() + 1.0
    close(flat(res.outputs["rev_v"]), ref(e["v"], pos), F32)
    close(flat(res.outputs["rev_c"]), ref(e["c"], pos), F32)
    close(flat(res.outputs["rev_s"]), ref(e["s"], pos), F32)


COMPARE = {
    "lt": (lambda x, y: x < y, torch.lt),
    "le": (lambda x, y: x <= y, torch.le),
    "gt": (lambda x, y: x > y, torch.gt),
    "ge": (lambda x, y: x >= y, torch.ge),
    "eq": (lambda x, y: x == y, torch.eq),
    "ne": (lambda x, y: x != y, torch.ne),
}


@pytest.mark.parametrize("name", list(COMPARE))
def test_comparisons_and_where(gen, name):
    f, ref = COMPARE[name]

    def prog(acc, r: cc.RowVec, v: cc.ColVec, t: cc.Tile, s: cc.Scalar):
        relu = cc.relu(acc)  # exact zeros, so == and != select both ways
        return {"by_r": cc.where(f(acc, r), acc, t), "by_v": cc.where(f(acc, v), t, acc),
                "by_t": cc.where(f(acc, t), r, v), "by_s": cc.where(f(acc, s), s, acc),
                "zero": cc.where(f(relu, 0.0), acc, -2.0),
                "coord": cc.where(f(acc.col % 4, acc.row % 3), 1.0, 0.0)}

    a, b = problem(gen)
    ops = operands(gen)
    ops["s"] = 0.0
    res = cc.evaluate(trace(prog), a, b, {k: v for k, v in ops.items() if k != "tab"})
    x, e = res.acc.double(), expanded(ops)
    relu = torch.where(x > 0, x, torch.zeros_like(x))
    rows, cols = torch.arange(M)[:, None], torch.arange(N)[None, :]
    expected = {
        "by_r": torch.where(ref(x, e["r"]), x, e["t"]), "by_v": torch.where(ref(x, e["v"]), e["t"], x),
        "by_t": torch.where(ref(x, e["t"]), e["r"], e["v"]), "by_s": torch.where(ref(x, e["s"]), e["s"], x),
        "zero": torch.where(ref(relu, torch.zeros_like(x)), x, torch.full_like(x, -2.0)),
        "coord": ref(cols % 4, rows % 3).double().expand(M, N),
    }
    for key, value in expected.items():
        close(flat(res.outputs[key]), value, EXACT)
    # the selections really went both ways (random floats are never equal; relu(x) < 0 never holds, >= 0 always)
    mixed = {"coord": flat(res.outputs["coord"]) == 1}
    if name not in ("eq", "ne"):
        mixed["by_r"] = flat(res.outputs["by_r"]) == x
    if name not in ("lt", "ge"):
        mixed["zero"] = flat(res.outputs["zero"]) == x
    for key, cond in mixed.items():
        assert cond.any() and not cond.all(), key


def test_logic_ops(gen):
    def prog(acc, t: cc.Tile):
        return {"and_": cc.where((acc > 0) & (t < 0), 1.0, 0.0), "or_": cc.where((acc > 0) | (t < 0), 1.0, 0.0),
                "not_": cc.where(~(acc > 0), 1.0, 0.0),
                "mix": cc.where(~((acc > t) | (acc.col == 2)) & (acc.row < 5), acc, t)}

    a, b = problem(gen)
    t = randn(gen, M, N)
    res = cc.evaluate(trace(prog), a, b, {"t": t})
    x, t64 = res.acc.double(), t.double()
    rows, cols = torch.arange(M)[:, None], torch.arange(N)[None, :]
    close(flat(res.outputs["and_"]), ((x > 0) & (t64 < 0)).double(), EXACT)
    close(flat(res.outputs["or_"]), ((x > 0) | (t64 < 0)).double(), EXACT)
    close(flat(res.outputs["not_"]), (x <= 0).double(), EXACT)
    close(flat(res.outputs["mix"]), torch.where(~((x > t64) | (cols == 2)) & (rows < 5), x, t64), EXACT)


def test_clamp(gen):
    def prog(acc, r: cc.RowVec, v: cc.ColVec):
        return {"both": cc.clamp(acc, -0.5, 0.25), "lo": cc.clamp(acc, lo=r), "hi": cc.clamp(acc, hi=v)}

    a, b = problem(gen)
    ops = {"r": randn(gen, M, scale=0.5), "v": randn(gen, N, scale=0.5)}
    res = cc.evaluate(trace(prog), a, b, ops)
    x = res.acc.double()
    close(flat(res.outputs["both"]), torch.minimum(torch.maximum(x, torch.tensor(-0.5)), torch.tensor(0.25)), EXACT)
    close(flat(res.outputs["lo"]), torch.maximum(x, ops["r"].double()[:, None]), EXACT)
    close(flat(res.outputs["hi"]), torch.minimum(x, ops["v"].double()[None, :]), EXACT)


# --------------------------------------------------------------------------- constants, coordinates, casts
def test_constants_including_infinities(gen):
    def prog(acc):
        masked = cc.where(acc.col < 3, acc, -math.inf)
        return {"affine": acc * 2 + 0.25, "max": cc.maximum(acc, -math.inf), "min": cc.minimum(acc, math.inf),
                "masked": masked, "top": cc.row_max(masked), "lse": cc.row_logsumexp(masked),
                "big": acc * 0 + (2**31 - 1)}

    a, b = problem(gen)
    res = cc.evaluate(trace(prog), a, b, tile=TILE)
    x = res.acc.double()
    close(flat(res.outputs["affine"]), x * 2 + 0.25, F32)
    close(flat(res.outputs["max"]), x, EXACT)
    close(flat(res.outputs["min"]), x, EXACT)
    masked = flat(res.outputs["masked"])
    assert torch.isneginf(masked[:, 3:]).all()
    close(masked[:, :3], x[:, :3], EXACT)
    close(res.outputs["top"].reshape(-1), x[:, :3].amax(1), EXACT)
    close(res.outputs["lse"].reshape(-1), x[:, :3].exp().sum(1).log(), F32)
    # the last partial tiles hold only -inf: finishing must still give the finite results
    close(finish("max", res.partials["top"]), res.outputs["top"].reshape(-1), EXACT)
    close(finish("logsumexp", res.partials["lse"]), res.outputs["lse"].reshape(-1), F32)
    close(flat(res.outputs["big"]), torch.full((M, N), 2.0**31), F32)


def test_coordinates_and_integer_ops(gen):
    """row is the flattened row index (batch dims included); // and % follow Python (floor)."""
    def prog(acc):
        return {"rc": (acc.row * 100 + acc.col).to(cc.f32),
                "div": ((acc.col - 7) // 3 * 10 + (acc.col - 7) % 3 + acc.row % 4).to(cc.f32),
                "tdiv": acc.col / 4, "sign": cc.where(acc > 0, 1, -1).to(cc.f32),
                "neg": (-abs(acc.col - 5) + cc.square(acc.row)).to(cc.f32)}

    a, b = problem(gen)
    res = cc.evaluate(trace(prog), a, b)
    rows, cols = torch.arange(M, dtype=torch.float64)[:, None], torch.arange(N, dtype=torch.float64)[None, :]
    assert res.outputs["rc"].shape == (*BATCH, N)
    close(flat(res.outputs["rc"]), (rows * 100 + cols).expand(M, N), EXACT)
    floor_div = torch.floor((cols - 7) / 3) * 10 + torch.remainder(cols - 7, 3) + rows % 4
    close(flat(res.outputs["div"]), floor_div.expand(M, N), EXACT)
    close(flat(res.outputs["tdiv"]), (cols / 4).expand(M, N), EXACT)
    close(flat(res.outputs["sign"]), torch.where(res.acc > 0, 1.0, -1.0), EXACT)
    close(flat(res.outputs["neg"]), (-(cols - 5).abs() + rows**2).expand(M, N), EXACT)


@pytest.mark.parametrize("target,torch_dtype", [(cc.bf16, torch.bfloat16), (cc.f16, torch.float16)])
def test_cast_rounds_in_the_middle_of_a_program(gen, target, torch_dtype):
    a, b = problem(gen)
    res = cc.evaluate(trace(lambda acc: {"err": (acc.to(target) - acc).to(cc.f32)}), a, b)
    x = res.acc
    err = flat(res.outputs["err"])
    close(err, x.to(torch_dtype).double() - x.double(), EXACT)  # Sterbenz: the difference is exact
    assert (err != 0).any()
    assert (err.abs() <= x.abs() * 2.0 ** -(8 if torch_dtype == torch.bfloat16 else 11) + 1e-30).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_input_dtype_cast_and_output_dtypes(gen, dtype):
    def prog(acc):
        return {"D": acc, "h": acc.to(cc.f16), "bf": acc.to(cc.bf16), "f": acc.to(cc.f32),
                "inp": acc.to(cc.input_dtype),
                "err": (acc.to(cc.input_dtype) - acc).to(cc.f32)}

    a, b = problem(gen, dtype)
    res = cc.evaluate(trace(prog), a, b)
    expect = gemm64(a, b)
    for key, dt in (("D", dtype), ("h", torch.float16), ("bf", torch.bfloat16), ("f", torch.float32), ("inp", dtype)):
        out = res.outputs[key]
        assert out.dtype == dt and out.shape == (*BATCH, N), key
        close(flat(out), stored(expect, dt), STORED[dt])
    x = res.acc
    close(flat(res.outputs["err"]), x.to(dtype).double() - x.double(), EXACT)


def test_integer_to_float_cast(gen):
    a, b = problem(gen, batch=(3,), n=4)
    res = cc.evaluate(trace(lambda acc: acc.col.to(cc.f32) + acc.row.to(cc.bf16)), a, b)
    close(res.outputs["D"], torch.arange(4.0)[None, :] + torch.arange(3.0)[:, None], EXACT)


# --------------------------------------------------------------------------- pairs, interleave, widths
def test_pairs_and_interleave(gen):
    def prog(acc, r: cc.RowVec):
        x0, x1 = cc.pairs(acc)
        return {"even": x0, "odd": x1, "swap": cc.interleave(x1, x0), "wide": cc.interleave(acc, -acc),
                "zero_odd": cc.interleave(x0, 0.0), "row_even": cc.interleave(r, x1),
                "roundtrip": cc.interleave(*cc.pairs(acc))}

    a, b = problem(gen)
    r = randn(gen, *BATCH)  # a RowVec may also come with A's batch shape
    res = cc.evaluate(trace(prog), a, b, {"r": r})
    x = res.acc.double()
    e, o = x[:, 0::2], x[:, 1::2]
    assert res.outputs["even"].shape == (*BATCH, N // 2) and res.outputs["wide"].shape == (*BATCH, 2 * N)
    close(flat(res.outputs["even"]), e, EXACT)
    close(flat(res.outputs["odd"]), o, EXACT)
    swap = torch.empty(M, N, dtype=torch.float64)
    swap[:, 0::2], swap[:, 1::2] = o, e
    close(flat(res.outputs["swap"]), swap, EXACT)
    wide = torch.empty(M, 2 * N, dtype=torch.float64)
    wide[:, 0::2], wide[:, 1::2] = x, -x
    close(flat(res.outputs["wide"]), wide, EXACT)
    zero_odd = torch.zeros(M, N, dtype=torch.float64)
    zero_odd[:, 0::2] = e
    close(flat(res.outputs["zero_odd"]), zero_odd, EXACT)
    row_even = torch.empty(M, N, dtype=torch.float64)
    row_even[:, 0::2], row_even[:, 1::2] = r.double().reshape(M, 1).expand(M, N // 2), o
    close(flat(res.outputs["row_even"]), row_even, EXACT)
    close(flat(res.outputs["roundtrip"]), x, EXACT)


def test_operands_of_every_width(gen):
    """ColVec/Tile/Table at N/2, N, 2N: each read in its own column space."""
    def prog(acc, vh: cc.ColVec["N/2"], th: cc.Tile["N/2"], tabh: cc.Table["N/2"],
             t2: cc.Tile["2N"], v2: cc.ColVec["2N"], tab2: cc.Table["2N"]):
        x0, x1 = cc.pairs(acc)
        g, u = cc.pairs(t2 * v2 + tab2)
        return {"half": x0 * vh + th * tabh - x1, "n": g * u + acc, "wide": cc.interleave(acc, acc) * v2 + tab2}

    a, b = problem(gen)
    ops = {"vh": randn(gen, N // 2), "th": randn(gen, M, N // 2), "tabh": randn(gen, 5, 3),
           "t2": randn(gen, *BATCH, 2 * N), "v2": randn(gen, 2 * N), "tab2": randn(gen, 4, 7)}
    res = cc.evaluate(trace(prog), a, b, ops)
    x = res.acc.double()
    rows = torch.arange(M)[:, None]
    c_half, c_wide = torch.arange(N // 2)[None, :], torch.arange(2 * N)[None, :]
    tabh = ops["tabh"].double()[rows % 5, c_half % 3]
    tab2 = ops["tab2"].double()[rows % 4, c_wide % 7]
    y = flat(ops["t2"]).double() * ops["v2"].double() + tab2
    assert res.outputs["half"].shape == (*BATCH, N // 2) and res.outputs["wide"].shape == (*BATCH, 2 * N)
    close(flat(res.outputs["half"]), x[:, 0::2] * ops["vh"].double() + ops["th"].double() * tabh - x[:, 1::2], F32)
    close(flat(res.outputs["n"]), y[:, 0::2] * y[:, 1::2] + x, F32)
    wide = torch.repeat_interleave(x, 2, dim=1)
    close(flat(res.outputs["wide"]), wide * ops["v2"].double() + tab2, F32)


# --------------------------------------------------------------------------- reductions and their partials
def _reduce64(x, kind, dim):
    if kind == "sum":
        return x.sum(dim)
    if kind == "sumsq":
        return (x * x).sum(dim)
    if kind == "max":
        return x.amax(dim)
    if kind == "maxabs":
        return x.abs().amax(dim)
    top = x.amax(dim, keepdim=True)
    return (top + (x - top).exp().sum(dim, keepdim=True).log()).squeeze(dim)


def _partials64(x, kind, axis, tile):
    """Per-tile partials written by hand: loops over the CTA tiles of an (M, cols) value."""
    m, cols = x.shape
    if axis == "row":
        step = tile[1] * cols // N  # a tile of tile_n accumulator columns covers width * tile_n value columns
        chunks = [x[:, i:i + step] for i in range(0, cols, step)]
        dim = 1
    else:
        chunks = [x[i:i + tile[0], :] for i in range(0, m, tile[0])]
        dim = 0
    if kind != "logsumexp":
        return torch.stack([_reduce64(c, kind, dim) for c in chunks])
    tops = torch.stack([c.amax(dim) for c in chunks])
    sums = torch.stack([(c - c.amax(dim, keepdim=True)).exp().sum(dim) for c in chunks])
    return torch.stack([tops, sums])


WIDTH_VALUES = {
    "N/2": lambda acc, t: cc.silu(cc.pairs(acc)[0]) * cc.pairs(t)[1],
    "N": lambda acc, t: acc * 2.0 + t,
    "2N": lambda acc, t: cc.interleave(acc, t),
}


def _width_value64(width, x, t):
    if width == "N/2":
        g = x[:, 0::2]
        return g / (1 + torch.exp(-g)) * t[:, 1::2]
    if width == "N":
        return x * 2.0 + t
    out = torch.empty(x.shape[0], 2 * x.shape[1], dtype=torch.float64)
    out[:, 0::2], out[:, 1::2] = x, t
    return out


@pytest.mark.parametrize("width", list(WIDTH_VALUES))
@pytest.mark.parametrize("axis", ["row", "col"])
@pytest.mark.parametrize("kind", ["sum", "sumsq", "max", "maxabs", "logsumexp"])
def test_reduction_outputs_and_partials(gen, kind, axis, width):
    def prog(acc, t: cc.Tile):
        y = WIDTH_VALUES[width](acc, t)
        return {"y": y.to(cc.f32), "red": cc.reduce(y, kind, axis)}

    a, b = problem(gen)
    t = randn(gen, *BATCH, N)
    res = cc.evaluate(trace(prog), a, b, {"t": t}, tile=TILE)
    y = _width_value64(width, gemm64(a, b), flat(t).double())
    cols = y.shape[1]
    close(flat(res.outputs["y"]), y, F32)

    finished = res.outputs["red"]
    assert finished.dtype == torch.float32
    if axis == "row":
        assert finished.shape == BATCH  # one value per row, A's batch dims restored
        close(finished.reshape(M), _reduce64(y, kind, 1), F32)
    else:
        assert finished.shape == (cols,)
        close(finished, _reduce64(y, kind, 0), F32)

    parts = res.partials["red"]
    tiles = -(-cols // (TILE[1] * cols // N)) if axis == "row" else -(-M // TILE[0])
    shape = (tiles, M) if axis == "row" else (tiles, cols)
    assert tiles > 1 and parts.dtype == torch.float32
    assert parts.shape == ((2,) + shape if kind == "logsumexp" else shape)
    close(parts, _partials64(y, kind, axis, TILE), F32)
    close(finish(kind, parts), finished.reshape(-1), F32)


@pytest.mark.parametrize("kind", ["sum", "max", "logsumexp"])
def test_default_tile_gives_one_partial_per_row(gen, kind):
    a, b = problem(gen)
    res = cc.evaluate(trace(lambda acc: {"r": cc.reduce(acc, kind, "row"), "c": cc.reduce(acc, kind, "col")}), a, b)
    lead = (2,) if kind == "logsumexp" else ()
    assert res.partials["r"].shape == lead + (1, M) and res.partials["c"].shape == lead + (1, N)
    close(finish(kind, res.partials["r"]), res.outputs["r"].reshape(-1), F32)
    close(finish(kind, res.partials["c"]), res.outputs["c"], F32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_reductions_see_fp32_values_not_stored_ones(gen, dtype):
    a, b = problem(gen, dtype)
    res = cc.evaluate(trace(lambda acc: {"D": acc, "s": cc.row_sum(acc), "c": cc.col_sumsq(acc)}), a, b)
    x = gemm64(a, b)
    assert res.outputs["D"].dtype == dtype
    close(res.outputs["s"].reshape(-1), x.sum(1), F32)
    close(res.outputs["c"], (x * x).sum(0), F32)


@pytest.mark.parametrize("kind", ["sum", "sumsq", "max", "maxabs", "logsumexp"])
def test_segment_reductions_feed_later_nodes(gen, kind):
    def prog(acc, v: cc.ColVec):
        y = acc * v
        x0, x1 = cc.pairs(y)
        return {"full": y - cc.reduce(y, kind, "row", segment=5),
                "half": x1 * cc.reduce(x0, kind, "row", segment=2)}

    a, b = problem(gen)
    v = nonzero(gen, N)
    res = cc.evaluate(trace(prog), a, b, {"v": v})
    y = gemm64(a, b) * v.double()
    seg = _reduce64(y.reshape(M, N // 5, 5), kind, 2).repeat_interleave(5, dim=1)
    close(flat(res.outputs["full"]), y - seg, F32)
    seg_half = _reduce64(y[:, 0::2].reshape(M, N // 4, 2), kind, 2).repeat_interleave(2, dim=1)
    close(flat(res.outputs["half"]), y[:, 1::2] * seg_half, F32)


def test_segment_softmax_and_reduction_of_a_segment_result(gen):
    def prog(acc):
        e = cc.exp(acc - cc.row_max(acc, segment=4))
        p = e / cc.row_sum(e, segment=4)
        return {"p": p.to(cc.f32), "total": cc.row_sum(p), "colmax": cc.col_max(p)}

    a, b = problem(gen)
    res = cc.evaluate(trace(prog), a, b, tile=TILE)
    probs = torch.softmax(gemm64(a, b).reshape(M, N // 4, 4), dim=-1).reshape(M, N)
    close(flat(res.outputs["p"]), probs, F32)
    close(res.outputs["total"].reshape(-1), torch.full((M,), N / 4, dtype=torch.float64), F32)
    close(res.outputs["colmax"], probs.amax(0), F32)
    close(finish("sum", res.partials["total"]), res.outputs["total"].reshape(-1), F32)


# --------------------------------------------------------------------------- library compositions
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_bias_gelu(gen, dtype):
    a, b = problem(gen, dtype)
    bias = randn(gen, N, dtype=dtype)
    d = cc.evaluate(library.get("bias_gelu"), a, b, {"bias": bias}).outputs["D"]
    x = gemm64(a, b) + bias.double()
    assert d.dtype == dtype and d.shape == (*BATCH, N)
    close(flat(d), stored(0.5 * x * (1 + torch.erf(x / math.sqrt(2))), dtype), STORED[dtype])


def _swiglu64(pre):
    gate, up = pre[:, 0::2], pre[:, 1::2]
    return gate / (1 + torch.exp(-gate)) * up


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_swiglu_with_and_without_saved_preactivation(gen, dtype):
    a, b = problem(gen, dtype)
    acc = gemm64(a, b)
    d = cc.evaluate(library.get("swiglu"), a, b).outputs["D"]
    assert d.dtype == dtype and d.shape == (*BATCH, N // 2)
    close(flat(d), stored(_swiglu64(acc), dtype), STORED[dtype])

    saved = cc.evaluate(library.get("swiglu_save"), a, b).outputs
    assert saved["D"].dtype == dtype and saved["preact"].dtype == dtype
    close(flat(saved["D"]), stored(_swiglu64(acc), dtype), STORED[dtype])
    assert saved["preact"].shape == (*BATCH, N)
    close(flat(saved["preact"]), stored(acc, dtype), STORED[dtype])


def _swiglu_grads(pre, dh):
    """dgate, dup of h = silu(gate) * up by torch.autograd."""
    gate = pre[:, 0::2].clone().requires_grad_(True)
    up = pre[:, 1::2].clone().requires_grad_(True)
    (torch.nn.functional.silu(gate) * up).backward(dh)
    return gate.grad, up.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_swiglu_backward_matches_autograd(gen, dtype):
    ffn, out_dim = 9, 6  # odd F is fine: the dgrad output is 2F wide, nothing is N/2
    dout = randn(gen, *BATCH, out_dim, dtype=dtype)
    w_down = randn(gen, out_dim, ffn, dtype=dtype, scale=out_dim**-0.5)
    preact = randn(gen, *BATCH, 2 * ffn, dtype=dtype, scale=2.0)
    dh = gemm64(dout, w_down.t())
    dgate, dup = _swiglu_grads(flat(preact).double(), dh)

    res = cc.evaluate(library.get("swiglu_bwd"), dout, w_down.t(), {"preact": preact})
    d = flat(res.outputs["D"])
    assert d.shape == (M, 2 * ffn) and d.dtype == dtype
    close(d[:, 0::2], stored(dgate, dtype), STORED[dtype])
    close(d[:, 1::2], stored(dup, dtype), STORED[dtype])

    rec = cc.evaluate(library.get("swiglu_bwd_recompute"), dout, w_down.t(), {"preact": preact}).outputs
    close(flat(rec["D"])[:, 0::2], stored(dgate, dtype), STORED[dtype])
    close(flat(rec["D"])[:, 1::2], stored(dup, dtype), STORED[dtype])
    assert rec["h"].shape == (*BATCH, ffn)
    close(flat(rec["h"]), stored(_swiglu64(flat(preact).double()), dtype), STORED[dtype])


def test_swiglu_save_feeds_swiglu_bwd(gen):
    """The forward's saved pre-activation is exactly what the backward program takes."""
    hidden, ffn = 12, 5
    x = randn(gen, *BATCH, hidden)
    w_gate_up = randn(gen, 2 * ffn, hidden, scale=hidden**-0.5)  # rows interleaved gate/up
    fwd = cc.evaluate(library.get("swiglu_save"), x, w_gate_up).outputs
    dh = randn(gen, *BATCH, ffn)
    bwd = cc.evaluate(library.get("swiglu_bwd"), dh, torch.eye(ffn), {"preact": fwd["preact"]}).outputs["D"]
    dgate, dup = _swiglu_grads(gemm64(x, w_gate_up), flat(dh).double())
    close(flat(bwd)[:, 0::2], dgate, F32)
    close(flat(bwd)[:, 1::2], dup, F32)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_residual_add_and_row_sumsq_partials(gen, dtype):
    a, b = problem(gen, dtype)
    residual = randn(gen, *BATCH, N, dtype=dtype)
    res = cc.evaluate(library.get("residual_sumsq"), a, b, {"residual": residual}, tile=TILE)
    h = res.outputs["D"]
    assert h.dtype == dtype and h.shape == (*BATCH, N)
    close(flat(h), stored(gemm64(a, b) + flat(residual).double(), dtype), STORED[dtype])
    # the statistics are of the stored (rounded) stream, which the next RMSNorm reads
    h64 = flat(h).double()
    assert res.outputs["sumsq"].shape == BATCH
    close(res.outputs["sumsq"].reshape(-1), (h64 * h64).sum(1), F32)
    parts = res.partials["sumsq"]
    assert parts.shape == (3, M)  # ceil(20 / 8) column tiles
    close(parts, torch.stack([(h64[:, i:i + 8] ** 2).sum(1) for i in (0, 8, 16)]), F32)
    close(finish("sumsq", parts), res.outputs["sumsq"].reshape(-1), F32)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_row_scale_and_column_scale(gen, dtype):
    a, b = problem(gen, dtype)
    rstd, gamma = nonzero(gen, *BATCH), nonzero(gen, N)  # rstd with A's batch shape, also accepted as (M,)
    acc = gemm64(a, b)
    d = cc.evaluate(library.get("rms_scale"), a, b, {"rstd": rstd.reshape(M)}).outputs["D"]
    close(flat(d), stored(acc * rstd.double().reshape(M, 1), dtype), STORED[dtype])
    d = cc.evaluate(library.get("rms_scale_gamma"), a, b, {"rstd": rstd, "gamma": gamma}).outputs["D"]
    close(flat(d), stored(acc * rstd.double().reshape(M, 1) * gamma.double().reshape(1, N), dtype), STORED[dtype])


def test_alpha_beta(gen):
    a, b = problem(gen)
    c = randn(gen, *BATCH, N, dtype=torch.bfloat16)  # operands may be stored in another float dtype
    d = cc.evaluate(library.get("alpha_beta"), a, b, {"c": c, "alpha": 0.75, "beta": -1.25}).outputs["D"]
    close(flat(d), 0.75 * gemm64(a, b) - 1.25 * flat(c).double(), F32)
    d = cc.evaluate(library.get("alpha_beta"), a, b, {"c": c, "alpha": 1, "beta": 0}).outputs["D"]
    close(flat(d), gemm64(a, b), F32)


def _rotate_half_reference(y, cos, sin, n_rot, head_dim):
    """Llama / Hugging Face RoPE on the first ``n_rot`` columns of y (batch, seq, n); the rest passes."""
    batch, seq, n = y.shape
    q = y[..., :n_rot].reshape(batch, seq, n_rot // head_dim, head_dim)
    cos_full = torch.cat([cos, cos], -1)[None, :, None, :]
    sin_full = torch.cat([sin, sin], -1)[None, :, None, :]
    rotated_half = torch.cat([-q[..., head_dim // 2:], q[..., :head_dim // 2]], -1)
    q = q * cos_full + rotated_half * sin_full
    return torch.cat([q.reshape(batch, seq, n_rot), y[..., n_rot:]], -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_rope_matches_rotate_half_on_permuted_weight_rows(gen, dtype):
    batch, seq, hidden, head_dim = 2, 5, 16, 8
    n_rot, n = 3 * head_dim, 4 * head_dim  # q and k heads rotated, one v head passed through
    x = randn(gen, batch, seq, hidden, dtype=dtype)
    w = randn(gen, n, hidden, dtype=dtype, scale=hidden**-0.5)  # rows in rotate-half order per head
    inv_freq = 10000.0 ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.arange(seq, dtype=torch.float64)[:, None] * inv_freq[None, :]  # (positions, head_dim/2)
    cos, sin = angles.cos(), angles.sin()
    # interleaved column 2i of a head is rotate-half column i, 2i+1 is column i + head_dim/2
    perm = torch.tensor([h * head_dim + i + j * head_dim // 2
                         for h in range(n // head_dim) for i in range(head_dim // 2) for j in (0, 1)])

    prog = library.get("rope_qkv").with_constants(rotary_cols=n_rot)
    res = cc.evaluate(prog, x, w[perm], {"cos": cos.float(), "sin": sin.float()})
    d = res.outputs["D"]
    assert d.shape == (batch, seq, n) and d.dtype == dtype
    y = gemm64(x, w).reshape(batch, seq, n)
    expected = _rotate_half_reference(y, cos, sin, n_rot, head_dim)[..., perm]
    close(d, stored(expected, dtype), STORED[dtype])
    # v columns pass through untouched, and the rotation did change q/k
    close(flat(d)[:, n_rot:], stored(res.acc[:, n_rot:].double(), dtype), EXACT)
    assert not torch.allclose(flat(d)[:, :n_rot].double(), stored(res.acc[:, :n_rot].double(), dtype), atol=1e-2)


def test_rope_is_a_complex_rotation_per_pair(gen):
    """Independent check: pair (2i, 2i+1) of a row at position p turns by angle[p, i % (head_dim/2)]."""
    seq, head_dim, heads = 3, 4, 3
    x = randn(gen, 2, seq, 10)
    w = randn(gen, heads * head_dim, 10)
    angles = torch.rand(seq, head_dim // 2, generator=gen, dtype=torch.float64) * 6.0
    res = cc.evaluate(library.get("rope_qkv"), x, w, {"cos": angles.cos().float(), "sin": angles.sin().float()})
    z = torch.view_as_complex(gemm64(x, w).reshape(2 * seq, heads * head_dim // 2, 2).contiguous())
    pos = torch.arange(2 * seq) % seq
    turn_angles = angles[pos].repeat(1, heads)  # column j of a row uses angle[pos, j % (head_dim/2)]
    turn = torch.polar(torch.ones_like(turn_angles), turn_angles)
    expected = torch.view_as_real(z * turn).reshape(2 * seq, heads * head_dim)
    close(flat(res.outputs["D"]), expected, F32)


def test_rmsnorm_backward_matches_autograd(gen):
    batch, seq, hidden, out_dim, eps = 2, 5, 12, 7, 1e-6
    x = randn(gen, batch, seq, hidden, dtype=torch.float64).requires_grad_(True)
    gamma = (randn(gen, hidden, dtype=torch.float64) + 1.0).requires_grad_(True)
    w = randn(gen, out_dim, hidden, dtype=torch.float64)
    g_out = randn(gen, batch, seq, out_dim, dtype=torch.float64)

    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * gamma
    (y @ w.t()).backward(g_out)
    rstd = torch.rsqrt(x.detach().pow(2).mean(-1) + eps)

    ops = {"x": x.detach().float(), "rstd": rstd.float(), "gamma": gamma.detach().float()}
    res = cc.evaluate(library.get("rmsnorm_bwd"), g_out.float(), w.t().float(), ops, tile=(4, 8))
    out = res.outputs
    assert out["D"].shape == (batch, seq, hidden)
    assert out["rowdot"].shape == (batch, seq) and out["dgamma"].shape == (hidden,)
    x_hat = x.detach() * rstd[..., None]
    dx = out["D"].double() - x_hat * rstd[..., None] * out["rowdot"].double()[..., None] / hidden
    close(dx, x.grad, dict(rtol=1e-4, atol=1e-5))  # dx is finished from three fp32 results
    close(out["dgamma"], gamma.grad, F32)
    assert res.partials["rowdot"].shape == (2, batch * seq) and res.partials["dgamma"].shape == (3, hidden)
    close(finish("sum", res.partials["rowdot"]), out["rowdot"].reshape(-1), F32)
    close(finish("sum", res.partials["dgamma"]), out["dgamma"], F32)


def test_rmsnorm_backward_with_residual_matches_autograd(gen):
    """h_out = h + f(rmsnorm(h) @ w.T): the residual's gradient and the weight gradient's input."""
    batch, seq, hidden, out_dim, eps = 2, 5, 12, 7, 1e-6
    x = randn(gen, batch, seq, hidden, dtype=torch.float64).requires_grad_(True)
    gamma = (randn(gen, hidden, dtype=torch.float64) + 1.0).requires_grad_(True)
    w = randn(gen, out_dim, hidden, dtype=torch.float64).requires_grad_(True)
    g_out = randn(gen, batch, seq, out_dim, dtype=torch.float64)
    g_res = randn(gen, batch, seq, hidden, dtype=torch.float64)

    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * gamma
    ((y @ w.t()) * g_out).sum().backward(retain_graph=True)
    (x * g_res).sum().backward()  # the residual branch
    rstd = torch.rsqrt(x.detach().pow(2).mean(-1) + eps)

    ops = {"x": x.detach().float(), "rstd": rstd.float(), "gamma": gamma.detach().float(), "dresidual": g_res.float()}
    out = cc.evaluate(library.get("rmsnorm_bwd_residual"), g_out.float(), w.detach().t().float(), ops,
                      tile=(4, 8)).outputs
    x_hat = x.detach() * rstd[..., None]
    dx = out["D"].double() - x_hat * rstd[..., None] * out["rowdot"].double()[..., None] / hidden
    close(dx, x.grad, dict(rtol=1e-4, atol=1e-5))
    close(out["dgamma"], gamma.grad, F32)
    close(out["x_norm"], y.detach(), F32)
    close(gemm64(g_out.reshape(-1, out_dim).t(), out["x_norm"].reshape(-1, hidden).t()), w.grad, F32)


def test_cross_entropy_stats_match_cross_entropy(gen):
    vocab, hidden = 20, 16  # M = 14 tokens != 20 classes
    h = randn(gen, *BATCH, hidden)
    w = randn(gen, vocab, hidden, scale=hidden**-0.5 * 3)
    target = torch.randint(0, vocab, BATCH, generator=gen)
    res = cc.evaluate(library.get("cross_entropy_stats"), h, w, {"target": target.float()}, tile=TILE)
    lse, tl = res.outputs["lse"], res.outputs["target_logit"]
    assert lse.shape == BATCH and tl.shape == BATCH
    logits = gemm64(h, w)
    expected = torch.nn.functional.cross_entropy(logits, target.reshape(-1), reduction="none")
    close((lse - tl).reshape(-1), expected, F32)
    close(tl.reshape(-1), logits.gather(1, target.reshape(-1, 1)).squeeze(1), F32)
    assert res.partials["lse"].shape == (2, 3, M) and res.partials["target_logit"].shape == (3, M)
    close(finish("logsumexp", res.partials["lse"]), lse.reshape(-1), F32)
    close(finish("sum", res.partials["target_logit"]), tl.reshape(-1), F32)


def _cross_entropy_case(gen, vocab: int = 20, hidden: int = 16):
    """h, w, target, dloss, the float64 logits h @ w.T with torch's gradient of dloss-weighted
    per-row cross-entropy in .grad, and that per-row loss."""
    h = randn(gen, *BATCH, hidden)
    w = randn(gen, vocab, hidden, scale=hidden**-0.5 * 3)
    target = torch.randint(0, vocab, BATCH, generator=gen)
    dloss = torch.rand(BATCH, generator=gen)
    logits = gemm64(h, w).requires_grad_()
    loss = torch.nn.functional.cross_entropy(logits, target.reshape(-1), reduction="none")
    loss.backward(dloss.reshape(-1).double())
    return h, w, target, dloss, logits, loss


def test_cross_entropy_exp_save_stores_what_scales_into_the_gradient(gen):
    """exp(logit - shift) stored, its row sum and the target logit: lse = shift + log(sumexp), and
    (stored - onehot * sumexp) * dloss / sumexp is cross-entropy's gradient of the logits."""
    h, w, target, dloss, logits, loss = _cross_entropy_case(gen)
    vocab = w.shape[0]
    shift = logits.detach().gather(1, target.reshape(-1, 1)).squeeze(1).float().reshape(BATCH) + 60.0
    out = cc.evaluate(library.get("cross_entropy_exp_save"), h, w, {"shift": shift, "target": target.float()},
                      tile=TILE).outputs
    exps, sumexp, tl = (out[k].reshape(-1, *out[k].shape[len(BATCH):]) for k in ("exp", "sumexp", "target_logit"))
    close(exps, torch.exp(logits.detach() - shift.reshape(-1, 1).double()), F32)
    close(sumexp, exps.sum(1), F32)
    close(shift.reshape(-1) + torch.log(sumexp) - tl, loss.detach(), F32)
    onehot = torch.nn.functional.one_hot(target.reshape(-1), vocab)
    close((exps - onehot * sumexp[:, None]) * (dloss.reshape(-1) / sumexp)[:, None], logits.grad, F32)


def test_cross_entropy_bwd_is_the_gradient_of_cross_entropy(gen):
    h, w, target, dloss, logits, _ = _cross_entropy_case(gen)
    vocab = w.shape[0]
    lse = torch.logsumexp(logits.detach(), -1).float().reshape(BATCH)
    d = cc.evaluate(library.get("cross_entropy_bwd"), h, w,
                    {"lse": lse, "target": target.float(), "dloss": dloss}).outputs["D"]
    close(d.reshape(-1, vocab), logits.grad, F32)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_qk_rmsnorm_is_a_per_head_rmsnorm(gen, dtype):
    heads, head_dim, eps = 3, 8, 1e-6
    a, b = problem(gen, dtype, n=heads * head_dim)
    gamma = nonzero(gen, heads * head_dim, dtype=dtype)
    prog = library.get("qk_rmsnorm").with_constants(head_dim=head_dim)
    d = cc.evaluate(prog, a, b, {"gamma": gamma}).outputs["D"]
    q = gemm64(a, b).reshape(M, heads, head_dim)
    normed = q / torch.sqrt(q.pow(2).mean(-1, keepdim=True) + eps)
    expected = normed.reshape(M, heads * head_dim) * gamma.double()
    assert d.dtype == dtype
    close(flat(d), stored(expected, dtype), STORED[dtype])
    d_eps = cc.evaluate(prog.with_constants(eps=1.0), a, b, {"gamma": gamma}).outputs["D"]
    normed = q / torch.sqrt(q.pow(2).mean(-1, keepdim=True) + 1.0)
    close(flat(d_eps), stored(normed.reshape(M, -1) * gamma.double(), dtype), STORED[dtype])


def test_float64_precision_for_checks_of_math():
    """precision=torch.float64: every value in fp64, outputs unrounded; casts in the program still round."""
    import coda_cute as cc

    @cc.epilogue
    def rounded(acc):
        return {"D": acc * (1.0 / 3.0), "E": (acc * (1.0 / 3.0)).to(cc.bf16).to(cc.f32), "S": cc.row_sum(acc)}

    a, b = torch.randn(8, 16), torch.randn(24, 16)
    out = cc.evaluate(rounded, a, b, precision=torch.float64).outputs
    exact = a.double() @ b.double().t()
    assert out["D"].dtype == torch.float64 and torch.equal(out["D"], exact * (1.0 / 3.0))
    assert torch.equal(out["E"], (exact / 3.0).to(torch.bfloat16).double())
    assert torch.allclose(out["S"], exact.sum(1), rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="precision"):
        cc.evaluate(rounded, a, b, precision=torch.float16)

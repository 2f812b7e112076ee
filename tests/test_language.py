"""The program language: every primitive can be written, composes, and builds the expected typed node.

These tests look at the traced graph (``Program.nodes`` / ``outputs``), not at numbers;
``test_reference.py`` checks what the graphs compute.
"""

import json
import math
from fractions import Fraction

import pytest
import torch

import coda_cute as cc
from coda_cute import library
from coda_cute.primitives import ELEMENTWISE
from coda_cute.program import REDUCTIONS, Program

HALF, ONE, TWO = Fraction(1, 2), Fraction(1), Fraction(2)


def trace(fn, name="prog", **constants) -> Program:
    return cc.epilogue(fn, name=name, **constants)


def out(prog: Program, name: str = "D"):
    """The node stored as output ``name``."""
    return next(o for o in prog.outputs if o.name == name).node


def loads(prog: Program) -> dict:
    return {n.attrs[0]: n for n in prog.nodes if n.op == "load"}


# --------------------------------------------------------------------------- elementwise
UNARY = [
    ("neg", lambda x: -x),
    ("abs", lambda x: abs(x)),
    ("exp", cc.exp),
    ("log", cc.log),
    ("sqrt", cc.sqrt),
    ("rsqrt", cc.rsqrt),
    ("tanh", cc.tanh),
    ("erf", cc.erf),
    ("sigmoid", cc.sigmoid),
    ("relu", cc.relu),
    ("gelu", cc.gelu),
    ("gelu_tanh", cc.gelu_tanh),
    ("silu", cc.silu),
    ("square", cc.square),
    ("square", lambda x: x**2),
]


@pytest.mark.parametrize("op,f", UNARY, ids=[f"{op}-{i}" for i, (op, _) in enumerate(UNARY)])
def test_unary_ops(op, f):
    node = out(trace(lambda acc: f(acc)))
    assert node.op == op
    assert [a.op for a in node.args] == ["acc"]
    assert (node.dtype, node.width) == ("f32", ONE)


@pytest.mark.parametrize("op,f,dtype", [
    ("neg", lambda x: -x, "i32"), ("abs", abs, "i32"), ("square", cc.square, "i32"),
    ("exp", cc.exp, "f32"), ("sqrt", cc.sqrt, "f32"), ("relu", cc.relu, "f32"),
])
def test_unary_ops_on_integers(op, f, dtype):
    """arith ops keep coordinates integral; float ops (exp, relu...) always give f32."""
    node = out(trace(lambda acc: (f(acc.col) + 0 * acc.col).to(cc.f32))).args[0].args[0]
    assert (node.op, node.dtype, node.width) == (op, dtype, ONE)


BINARY = [
    ("add", lambda x, y: x + y),
    ("sub", lambda x, y: x - y),
    ("mul", lambda x, y: x * y),
    ("div", lambda x, y: x / y),
    ("minimum", cc.minimum),
    ("maximum", cc.maximum),
]


@pytest.mark.parametrize("op,f", BINARY, ids=[op for op, _ in BINARY])
def test_binary_ops_with_operand(op, f):
    def prog(acc, v: cc.ColVec):
        return f(acc, v)

    node = out(trace(prog))
    assert node.op == op
    assert [(a.op, a.attrs) for a in node.args] == [("acc", ()), ("load", ("v",))]
    assert (node.dtype, node.width) == ("f32", ONE)


@pytest.mark.parametrize("f,op,args", [
    (lambda acc: 2.0 - acc, "sub", [("const", (2.0,)), ("acc", ())]),
    (lambda acc: 2.0 / acc, "div", [("const", (2.0,)), ("acc", ())]),
    (lambda acc: 3 + acc, "add", [("const", (3,)), ("acc", ())]),
    (lambda acc: 3 * acc, "mul", [("const", (3,)), ("acc", ())]),
    (lambda acc: acc - 1, "sub", [("acc", ()), ("const", (1,))]),
])
def test_reflected_operators_keep_argument_order(f, op, args):
    node = out(trace(f))
    assert node.op == op
    assert [(a.op, a.attrs) for a in node.args] == args


@pytest.mark.parametrize("op,f", [
    ("lt", lambda x, y: x < y), ("le", lambda x, y: x <= y), ("gt", lambda x, y: x > y),
    ("ge", lambda x, y: x >= y), ("eq", lambda x, y: x == y), ("ne", lambda x, y: x != y),
])
def test_comparisons_make_bools_used_by_where(op, f):
    def prog(acc, r: cc.RowVec):
        return cc.where(f(acc, r), acc, 0.0)

    node = out(trace(prog))
    cond = node.args[0]
    assert node.op == "where" and (node.dtype, node.width) == ("f32", ONE)
    assert (cond.op, cond.dtype, cond.width) == (op, "bool", ONE)
    assert [a.op for a in cond.args] == ["acc", "load"]


def test_reflected_comparison_with_constant_on_the_left():
    cond = out(trace(lambda acc: cc.where(0.5 < acc, acc, 0.0))).args[0]
    assert cond.op == "gt" and cond.args[0].op == "acc" and cond.args[1].attrs == (0.5,)


def test_logic_ops_and_or_not():
    def prog(acc, t: cc.Tile):
        return cc.where(~((acc > 0) & (t < 0)) | (acc.col == 3), acc, t)

    cond = out(trace(prog)).args[0]
    assert (cond.op, cond.dtype) == ("or_", "bool")
    assert cond.args[0].op == "not_" and cond.args[0].args[0].op == "and_"
    assert cond.args[1].op == "eq" and cond.args[1].args[0].op == "col"


def test_where_with_integer_branches_is_integer():
    node = out(trace(lambda acc: cc.where(acc > 0, 1, -1).to(cc.f32))).args[0]
    assert (node.op, node.dtype, node.width) == ("where", "i32", ONE)


def test_clamp_variants():
    node = out(trace(lambda acc: cc.clamp(acc, -1.0, 1.0)))
    assert node.op == "minimum" and node.args[1].attrs == (1.0,)
    assert node.args[0].op == "maximum" and node.args[0].args[1].attrs == (-1.0,)
    assert out(trace(lambda acc: cc.clamp(acc, lo=0.0))).op == "maximum"
    assert out(trace(lambda acc: cc.clamp(acc, hi=0.0))).op == "minimum"
    assert out(trace(lambda acc: cc.clamp(acc))).op == "acc"

    def with_vectors(acc, lo: cc.RowVec, hi: cc.ColVec):
        return cc.clamp(acc, lo, hi)

    node = out(trace(with_vectors))
    assert node.op == "minimum" and node.args[1].attrs == ("hi",) and node.args[0].args[1].attrs == ("lo",)


def test_every_elementwise_op_composes_in_one_program():
    def kitchen_sink(acc, r: cc.RowVec, v: cc.ColVec, t: cc.Tile, s: cc.Scalar):
        x = cc.gelu(acc + v) - cc.gelu_tanh(acc * r) + cc.silu(acc / (abs(v) + 1.0))
        y = cc.exp(-cc.square(acc)) + cc.erf(t) + cc.log(abs(t) + 1.0) + cc.sqrt(abs(acc)) * cc.rsqrt(abs(t) + 1.0)
        z = cc.tanh(acc) + cc.sigmoid(t) + cc.relu(acc - s) + cc.minimum(acc, t) + cc.maximum(acc, r)
        cond = ((acc < v) & (acc <= t)) | ~((acc > r) | (acc >= s)) | (acc.col == 1) | (acc.row != 2)
        mask = cc.where((acc.col // 2) % 2 == 0, 1.0, 0.0)
        return cc.where(cond, x + y, z) * mask

    prog = trace(kitchen_sink)
    assert set(ELEMENTWISE) <= {n.op for n in prog.nodes}


# --------------------------------------------------------------------------- constants
def test_constants():
    node = out(trace(lambda acc: acc * 2 + 0.25))
    two, quarter = node.args[0].args[1], node.args[1]
    assert (two.op, two.attrs, two.dtype, two.width) == ("const", (2,), "i32", None)
    assert (quarter.op, quarter.attrs, quarter.dtype) == ("const", (0.25,), "f32")
    for value in (math.inf, -math.inf, 2**31 - 1, -(2**31), -0.0, 1e-30):
        const = out(trace(lambda acc: cc.maximum(acc, value))).args[1]
        assert const.attrs == (value,) and const.op == "const"


def test_integer_coordinate_arithmetic():
    node = out(trace(lambda acc: ((acc.col * 2 + 1) % 3 + acc.row // 2).to(cc.f32))).args[0]
    assert (node.op, node.dtype) == ("add", "i32")
    assert out(trace(lambda acc: acc * (acc.col / 2))).args[1].dtype == "f32"
    assert out(trace(lambda acc: acc + (acc.col + 0.5))).args[1].dtype == "f32"
    assert out(trace(lambda acc: acc + acc.col)).dtype == "f32"
    row_mod = out(trace(lambda acc: cc.where(acc.row % 2 == 0, acc, -acc))).args[0].args[0]
    assert (row_mod.op, row_mod.dtype, row_mod.width) == ("mod", "i32", None)


# --------------------------------------------------------------------------- pairs / interleave
def test_pairs_halves_and_interleave_doubles_the_width():
    def prog(acc, preact: cc.Tile["2N"]):
        x0, x1 = cc.pairs(acc)
        g, u = cc.pairs(preact)
        return {"half": x0 * x1, "n": g * u + acc, "pair": cc.interleave(x1, x0),
                "wide": cc.interleave(acc, g), "zeros": cc.interleave(x0, 0.0)}

    p = trace(prog)
    x0, x1 = out(p, "half").args
    assert [(x.op, x.attrs, x.width, x.args[0].op) for x in (x0, x1)] == [
        ("pair", (0,), HALF, "acc"), ("pair", (1,), HALF, "acc")]
    g = out(p, "n").args[0].args[0]
    assert (g.op, g.width, g.args[0].attrs) == ("pair", ONE, ("preact",))
    assert [out(p, k).width for k in ("half", "n", "pair", "wide", "zeros")] == [HALF, ONE, ONE, TWO, ONE]
    assert out(p, "pair").op == "interleave" and out(p, "pair").args == (x1, x0)
    assert out(p, "zeros").args[1].op == "const"


def test_pairs_and_interleave_of_integers():
    even, odd = cc.pairs(_col_expr())
    assert (even.node.dtype, even.node.width) == ("i32", HALF)
    node = out(trace(lambda acc: cc.interleave(*cc.pairs(acc.col)).to(cc.f32))).args[0]
    assert (node.op, node.dtype, node.width) == ("interleave", "i32", ONE)


def _col_expr():
    holder = {}

    def grab(acc):
        holder["col"] = acc.col
        return acc

    trace(grab)
    return holder["col"]


# --------------------------------------------------------------------------- operands
def test_operand_kinds_and_widths():
    def prog(acc, r: cc.RowVec, v: cc.ColVec, vh: cc.ColVec["N/2"], t: cc.Tile, t2: cc.Tile["2N"],
             th: cc.Tile["N/2"], s: cc.Scalar, tab: cc.Table, tabh: cc.Table["N/2"], v2: cc.ColVec["2N"]):
        x0, x1 = cc.pairs(acc)
        g, u = cc.pairs(t2 * v2)
        half = (x0 * vh + th) * tabh
        return cc.interleave(half, x1) * r + v * t * s * tab + g * u

    p = trace(prog)
    assert [(o.name, o.kind, o.width) for o in p.operands] == [
        ("r", "row", None), ("v", "col", ONE), ("vh", "col", HALF), ("t", "tile", ONE),
        ("t2", "tile", TWO), ("th", "tile", HALF), ("s", "scalar", None), ("tab", "table", ONE),
        ("tabh", "table", HALF), ("v2", "col", TWO)]
    widths = {name: n.width for name, n in loads(p).items()}
    assert widths == {o.name: o.width for o in p.operands}
    assert p.operand("vh").describe() == "vh: col (N/2,)"
    assert p.operand("t2").describe() == "t2: tile (M, 2N)"
    assert p.operand("r").describe() == "r: row (M,)"
    assert p.operand("s").describe() == "s: scalar runtime float"
    assert "T[row % R, col % P], col in N/2" in p.operand("tabh").describe()
    with pytest.raises(KeyError):
        p.operand("nope")
    assert repr(cc.ColVec["N/2"]) == "coda_cute.ColVec['N/2']"
    assert cc.Table["2N"].width == TWO and cc.Tile[" N / 2 "].width == HALF


def test_coordinates():
    def prog(acc, t2: cc.Tile["2N"]):
        x0, _ = cc.pairs(acc)
        return {"a": (acc.row + acc.col).to(cc.f32), "b": (x0.col * 1).to(cc.f32), "c": (t2.col + 0).to(cc.f32),
                "d": (x0.row + x0.col).to(cc.f32)}

    p = trace(prog)
    cols = {n.width for n in p.nodes if n.op == "col"}
    rows = [n for n in p.nodes if n.op == "row"]
    assert cols == {HALF, ONE, TWO}
    assert rows and all((n.dtype, n.width) == ("i32", None) for n in rows)
    assert [out(p, k).width for k in "abcd"] == [ONE, HALF, TWO, HALF]


# --------------------------------------------------------------------------- casts and output dtypes
@pytest.mark.parametrize("dtype,name", [
    (cc.bf16, "bf16"), (torch.bfloat16, "bf16"), ("bfloat16", "bf16"), (cc.f16, "f16"), (torch.float16, "f16"),
    ("half", "f16"), (cc.f32, "f32"), (torch.float32, "f32"), ("fp32", "f32"), (cc.input_dtype, "in"),
])
def test_casts(dtype, name):
    p = trace(lambda acc: {"mid": acc.to(dtype) * 2.0, "end": (acc * 2.0).to(dtype)})
    mid = out(p, "mid").args[0]
    assert (mid.op, mid.attrs, mid.dtype, mid.width) == ("cast", (name,), "f32", ONE)
    dtypes = {o.name: o.dtype for o in p.outputs}
    assert dtypes == {"mid": None, "end": name}  # only a final cast sets the stored dtype


def test_output_dtypes():
    p = trace(lambda acc: {"D": acc, "a": acc.to(cc.f16), "b": acc.to(cc.bf16).to(cc.f32), "c": acc.to(cc.input_dtype)})
    assert [(o.name, o.dtype) for o in p.outputs] == [("D", None), ("a", "f16"), ("b", "f32"), ("c", "in")]
    assert out(p, "b").args[0].attrs == ("bf16",)


def test_single_expression_is_output_D():
    p = trace(lambda acc: acc + 1.0)
    assert [o.name for o in p.outputs] == ["D"] and not p.reductions and p.tile_outputs == p.outputs


# --------------------------------------------------------------------------- reductions
REDUCERS = {(axis, k): getattr(cc, f"{axis}_{k}") for k in REDUCTIONS for axis in ("row", "col")}


@pytest.mark.parametrize("axis,kind", sorted(REDUCERS))
def test_reductions_are_outputs(axis, kind):
    def prog(acc, v: cc.ColVec):
        y = acc * v
        return {"D": y, "r": REDUCERS[axis, kind](y), "g": cc.reduce(acc, kind, axis)}

    p = trace(prog)
    assert [(o.name, o.reduce, o.axis, o.is_reduction) for o in p.outputs] == [
        ("D", None, None, False), ("r", kind, axis, True), ("g", kind, axis, True)]
    assert [o.name for o in p.reductions] == ["r", "g"] and [o.name for o in p.tile_outputs] == ["D"]
    assert out(p, "r") is out(p, "D")  # the reduced value is the stored one, not a copy
    assert out(p, "g").op == "acc"


def test_reduction_of_half_and_double_width_values():
    p = trace(lambda acc: {"h": cc.row_sum(cc.pairs(acc)[0]), "w": cc.col_max(cc.interleave(acc, acc))})
    assert out(p, "h").width == HALF and out(p, "w").width == TWO


@pytest.mark.parametrize("kind", REDUCTIONS)
def test_segment_reductions_feed_later_nodes(kind):
    def prog(acc, v: cc.ColVec):
        seg = cc.reduce(acc * v, kind, "row", segment=4)
        return acc - seg

    node = out(trace(prog))
    seg = node.args[1]
    assert (seg.op, seg.attrs, seg.dtype, seg.width) == ("segreduce", (kind, 4), "f32", ONE)
    assert seg.args[0].op == "mul"
    helper = getattr(cc, f"row_{kind}")

    def over_pairs(acc):
        x0, x1 = cc.pairs(acc)
        return x1 / helper(x0, segment=2)

    seg = out(trace(over_pairs)).args[1]
    assert (seg.op, seg.attrs, seg.width) == ("segreduce", (kind, 2), HALF)


def test_segment_reduction_as_a_stored_reduction_input():
    p = trace(lambda acc: {"m": cc.row_sum(acc - cc.row_max(acc, segment=8))})
    assert out(p, "m").args[1].attrs == ("max", 8)


# --------------------------------------------------------------------------- constants as parameters
@cc.epilogue
def scaled(acc, bias: cc.ColVec, *, alpha=2.0, shift=3):
    """D = alpha * acc + bias + shift."""
    return alpha * acc + bias + shift


def _const_values(prog):
    return sorted((n.attrs[0], n.dtype) for n in prog.nodes if n.op == "const")


def test_with_constants_makes_a_variant():
    assert scaled.constants == {"alpha": 2.0, "shift": 3}
    assert _const_values(scaled) == [(2.0, "f32"), (3, "i32")]
    variant = scaled.with_constants(alpha=0.5)
    assert variant.name == scaled.name and variant.constants == {"alpha": 0.5, "shift": 3}
    assert _const_values(variant) == [(0.5, "f32"), (3, "i32")]
    assert _const_values(scaled) == [(2.0, "f32"), (3, "i32")]  # the original is untouched
    again = variant.with_constants(shift=-7)
    assert again.constants == {"alpha": 0.5, "shift": -7}
    assert [o.name for o in again.operands] == ["bias"]


def test_constants_given_to_the_decorator():
    p = cc.epilogue(alpha=-1.5)(scaled.fn)
    assert p.name == "scaled" and p.constants["alpha"] == -1.5
    assert _const_values(p) == [(-1.5, "f32"), (3, "i32")]


def test_library_constants_reach_the_graph():
    qk = library.get("qk_rmsnorm").with_constants(head_dim=8, eps=1e-5)
    seg = next(n for n in qk.nodes if n.op == "segreduce")
    assert seg.attrs == ("sumsq", 8)
    assert (1e-5, "f32") in _const_values(qk) and (8, "i32") in _const_values(qk)
    rope = library.get("rope_qkv").with_constants(rotary_cols=48)
    assert (24, "i32") in _const_values(rope)


# --------------------------------------------------------------------------- value names (hints)
def test_values_are_named_after_local_variables():
    def named(acc, bias: cc.ColVec):
        pre = acc + bias
        alias = pre  # noqa: F841  (a second name: the first one wins)
        _private = pre * 2.0
        unused = acc - 1.0  # noqa: F841  (not reachable from an output)
        gate, up = cc.pairs(_private)
        act = cc.silu(gate) * up
        return {"D": act, "stat": cc.row_sumsq(act)}

    p = trace(named)
    hints = {n.hint: n for n in p.nodes if n.hint}
    assert set(hints) == {"pre", "gate", "up", "act"}
    assert hints["pre"].op == "add" and hints["act"].op == "mul"
    assert hints["gate"].attrs == (0,) and hints["up"].attrs == (1,)
    assert all(n.hint is None for n in p.nodes if n.op in ("acc", "load", "const"))
    assert not any(n.op == "sub" for n in p.nodes)
    assert "pairs((pre * 2.0))[0]" == hints["gate"].expand()


def test_unsafe_local_names_are_not_used_as_hints():
    def prog(acc):
        é = acc + 1.0  # noqa: PLC2401  (not ASCII: no hint)
        match = é * 2.0  # a soft keyword: no hint
        return match - 3.0

    p = trace(prog)
    assert [n.hint for n in p.nodes if n.hint] == []


def test_tracing_under_a_profiler_or_debugger_keeps_names_and_their_hook():
    import cProfile
    import sys

    def prog(acc, bias: cc.ColVec):
        pre = acc + bias
        return {"D": cc.gelu(pre)}

    plain = trace(prog)
    profiler = cProfile.Profile()  # a C-level profile hook: cannot be re-installed with sys.setprofile
    profiler.enable()
    try:
        profiled = trace(prog)
    finally:
        profiler.disable()
    seen = []

    def tracer(frame, event, arg):
        seen.append(event)
        return None

    sys.settrace(tracer)
    try:
        traced = trace(prog)
        still_installed = sys.gettrace() is tracer
    finally:
        sys.settrace(None)
    assert still_installed and seen
    assert plain.fingerprint == profiled.fingerprint == traced.fingerprint
    assert [n.hint for n in profiled.nodes if n.hint] == ["pre"]


# --------------------------------------------------------------------------- describe / program API
def test_describe_lists_operands_values_and_outputs():
    def layer(acc, x: cc.Tile, rstd: cc.RowVec, gamma: cc.ColVec["N/2"]):
        """A test program.

        Second paragraph is not shown.
        """
        gate, up = cc.pairs(acc)
        h = cc.silu(gate) * up * gamma
        return {"D": h.to(cc.bf16), "x_out": x * rstd, "ss": cc.row_sumsq(h), "cm": cc.col_max(x)}

    prog = trace(layer, name="layer")
    text = prog.describe()
    lines = text.splitlines()
    assert lines[0] == f"program layer  (fingerprint {prog.fingerprint[:16]})"
    assert lines[1] == "  A test program."
    assert "Second paragraph" not in text
    for expected in [
        "  x: tile (M, N)", "  rstd: row (M,)", "  gamma: col (N/2,)",
        "  gate = pairs(acc)[0]   [f32, N/2]", "  up = pairs(acc)[1]   [f32, N/2]",
        "  h = ((silu(gate) * up) * gamma)   [f32, N/2]",
        "  D = h.to(bf16)  tile (M, N/2), bf16", "  x_out = (x * rstd)  tile (M, N), input dtype",
        "  ss = row_sumsq(h)  per row (M,), fp32 partials", "  cm = col_max(x)  per column (N,), fp32 partials",
    ]:
        assert expected in lines, (expected, text)
    assert lines.index("operands:") < lines.index("values:") < lines.index("outputs:")


def test_describe_of_accumulator_only_program_and_segments():
    text = library.get("gemm").describe()
    assert "  (accumulator only)" in text and "  D = acc  tile (M, N), input dtype" in text
    qk = library.get("qk_rmsnorm").with_constants(head_dim=16).describe()
    assert "row_sumsq(acc, segment=16)" in qk


def test_nodes_are_topologically_sorted_and_shared():
    def prog(acc, v: cc.ColVec):
        y = acc + v
        return {"D": y * y, "E": cc.exp(y)}

    p = trace(prog)
    position = {id(n): i for i, n in enumerate(p.nodes)}
    assert len(position) == len(p.nodes)
    assert all(position[id(a)] < position[id(n)] for n in p.nodes for a in n.args)
    assert sum(1 for n in p.nodes if n.op == "add") == 1  # y computed once, used three times
    assert p.uses("exp") and p.uses("load") and not p.uses("pair")
    assert repr(p).startswith("<coda_cute.Program prog ")
    json.loads(p.canonical())


def test_library_programs():
    programs = library.programs()
    assert {"gemm", "bias_gelu", "alpha_beta", "cross_entropy_stats", "cross_entropy_stats_save", "cross_entropy_bwd", "swiglu", "swiglu_save", "swiglu_bwd",
            "swiglu_bwd_recompute", "residual_sumsq", "rms_scale", "rms_scale_gamma", "rmsnorm_bwd", "rmsnorm_bwd_residual",
            "rmsnorm_bwd_rowdot", "qk_rmsnorm", "rope_qkv"} <= set(programs)
    assert all(isinstance(p, Program) and p.name == name for name, p in programs.items())
    assert library.get("swiglu") is programs["swiglu"]
    assert out(programs["swiglu"]).width == HALF and out(programs["swiglu_bwd"]).width == TWO
    with pytest.raises(cc.ProgramError, match="no library program named 'nope'; available: .*swiglu"):
        library.get("nope")

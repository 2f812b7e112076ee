"""Every refusal: the exception type and what its message tells the user.

Program errors (``ProgramError``) are raised while a program is traced or built;
argument errors (``ArgumentError``) when tensors are bound to it (the reference
interpreter and the kernels share ``arguments.bind``).
"""

import json
import math
import re
from fractions import Fraction

import pytest
import torch

import coda_cute as cc
from coda_cute import library
from coda_cute.program import Node, Operand, Output, Program

M, N, K = 6, 8, 4


def trace(fn, name="prog", **constants):
    return cc.epilogue(fn, name=name, **constants)


def raises_program(pattern):
    return pytest.raises(cc.ProgramError, match=pattern)


def raises_argument(pattern):
    return pytest.raises(cc.ArgumentError, match=pattern)


def ab(m=M, n=N, k=K, dtype=torch.float32):
    return torch.randn(m, k).to(dtype), torch.randn(n, k).to(dtype)


def test_error_hierarchy():
    assert issubclass(cc.ProgramError, cc.CodaError) and issubclass(cc.ProgramError, ValueError)
    assert issubclass(cc.ArgumentError, cc.CodaError) and issubclass(cc.ArgumentError, ValueError)
    assert issubclass(cc.UnsupportedError, cc.CodaError) and issubclass(cc.UnsupportedError, NotImplementedError)


# --------------------------------------------------------------------------- operands at call time
@cc.epilogue
def every_kind(acc, r: cc.RowVec, v: cc.ColVec, vh: cc.ColVec["N/2"], t: cc.Tile, t2: cc.Tile["2N"],
               s: cc.Scalar, tab: cc.Table):
    x0, _ = cc.pairs(acc)
    g, u = cc.pairs(t2)
    return {"D": acc * r + v * t * s * tab + g * u, "half": x0 * vh}


def good_operands(m=M, n=N):
    return {"r": torch.randn(m), "v": torch.randn(n), "vh": torch.randn(n // 2), "t": torch.randn(m, n),
            "t2": torch.randn(m, 2 * n), "s": 0.5, "tab": torch.randn(3, 4)}


def test_good_operands_are_accepted():
    a, b = ab()
    out = cc.evaluate(every_kind, a, b, good_operands()).outputs
    assert out["D"].shape == (M, N) and out["half"].shape == (M, N // 2)


def test_unknown_operand():
    a, b = ab()
    with raises_argument(r"unknown operand\(s\) \['bais'\] for program 'bias_gelu'; its operands are \['bias'\]"):
        cc.evaluate(library.get("bias_gelu"), a, b, {"bias": torch.randn(N), "bais": torch.randn(N)})
    with raises_argument(r"unknown operand\(s\) \['x'\] for program 'gemm'; its operands are none"):
        cc.evaluate(library.get("gemm"), a, b, {"x": torch.randn(N)})


def test_missing_operand():
    a, b = ab()
    with raises_argument(r"program 'bias_gelu' needs operand 'bias' \(bias: col \(N,\)\)"):
        cc.evaluate(library.get("bias_gelu"), a, b)
    ops = good_operands()
    del ops["s"]
    with raises_argument(r"needs operand 's' \(s: scalar runtime float\)"):
        cc.evaluate(every_kind, a, b, ops)


@pytest.mark.parametrize("name,value,pattern", [
    ("r", torch.randn(N), rf"'r' is a RowVec: expected shape \({M},\) \(one value per row\), got \({N},\)"),
    ("r", torch.randn(M, 1), rf"'r' is a RowVec: expected shape \({M},\).*got \({M}, 1\)"),
    ("v", torch.randn(M), rf"'v' is a ColVec N wide: expected shape \({N},\), got \({M},\)"),
    ("v", torch.randn(1, N), rf"'v' is a ColVec N wide: expected shape \({N},\), got \(1, {N}\)"),
    ("vh", torch.randn(N), rf"'vh' is a ColVec N/2 wide: expected shape \({N // 2},\), got \({N},\)"),
    ("t", torch.randn(N, M), rf"'t' is a Tile N wide: expected shape \({M}, {N}\), got \({N}, {M}\)"),
    ("t", torch.randn(M, N, 1), rf"'t' is a Tile N wide: expected shape \({M}, {N}\), got \({M}, {N}, 1\)"),
    ("t2", torch.randn(M, N), rf"'t2' is a Tile 2N wide: expected shape \({M}, {2 * N}\), got \({M}, {N}\)"),
    ("tab", torch.randn(4), r"'tab' is a Table: expected a 2-D tensor \(R, P\), got shape \(4,\)"),
    ("tab", torch.randn(2, 3, 4), r"'tab' is a Table: expected a 2-D tensor \(R, P\), got shape \(2, 3, 4\)"),
    ("tab", torch.randn(0, 4), r"'tab' is a Table: expected a 2-D tensor \(R, P\), got shape \(0, 4\)"),
    ("s", torch.tensor(0.5), r"'s' is a Scalar: expected a Python float, got Tensor"),
    ("s", True, r"'s' is a Scalar: expected a Python float, got bool"),
    ("s", "0.5", r"'s' is a Scalar: expected a Python float, got str"),
    ("t", [[0.0] * N] * M, r"operand 't' \(t: tile \(M, N\)\) must be a tensor, got list"),
    ("v", 1.0, r"operand 'v' \(v: col \(N,\)\) must be a tensor, got float"),
])
def test_operand_shape_and_kind_mismatch(name, value, pattern):
    a, b = ab()
    ops = good_operands()
    ops[name] = value
    with raises_argument(pattern):
        cc.evaluate(every_kind, a, b, ops)


def test_operand_shapes_follow_batch_dims_of_a():
    a, b = torch.randn(2, 3, K), torch.randn(N, K)
    ok = good_operands(m=6)
    ok["r"], ok["t"] = torch.randn(2, 3), torch.randn(2, 3, N)  # batch-shaped forms are accepted
    cc.evaluate(every_kind, a, b, ok)
    bad = dict(ok, r=torch.randn(3, 2))
    with raises_argument(r"'r' is a RowVec: expected shape \(6,\).*got \(3, 2\)"):
        cc.evaluate(every_kind, a, b, bad)
    bad = dict(ok, t=torch.randn(3, 2, N))
    with raises_argument(rf"'t' is a Tile N wide: expected shape \(6, {N}\), got \(3, 2, {N}\)"):
        cc.evaluate(every_kind, a, b, bad)


# --------------------------------------------------------------------------- the GEMM inputs
def test_k_mismatch():
    with raises_argument(r"K mismatch: A is \(6, 4\) \(K=4\) but B is \(8, 5\) \(K=5\); .*B must be \(N, K\)"):
        cc.evaluate(library.get("gemm"), torch.randn(6, 4), torch.randn(8, 5))
    with raises_argument(r"K mismatch: A is \(2, 3, 5\) \(K=5\) but B is \(5, 4\) \(K=4\)"):
        cc.evaluate(library.get("gemm"), torch.randn(2, 3, 5), torch.randn(5, 4))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.int8, torch.float64, torch.bool])
def test_unsupported_input_dtypes(dtype):
    a, b = ab()
    with raises_argument(rf"A has dtype {dtype}; expected bfloat16, float16 or float32"):
        cc.evaluate(library.get("gemm"), a.to(dtype), b.to(dtype))
    with raises_argument(rf"B has dtype {dtype}; expected bfloat16, float16 or float32"):
        cc.evaluate(library.get("gemm"), a, b.to(dtype))
    with raises_argument(rf"operand 'bias' has dtype {dtype}; expected bfloat16, float16 or float32"):
        cc.evaluate(library.get("bias_gelu"), a, b, {"bias": torch.ones(N).to(dtype)})


def test_other_gemm_input_errors():
    a, b = ab()
    with raises_argument(r"A is torch.float32 but B is torch.bfloat16; both GEMM inputs must have one dtype"):
        cc.evaluate(library.get("gemm"), a, b.bfloat16())
    with raises_argument(r"A must be a tensor of shape \(..., K\), got shape \(4,\)"):
        cc.evaluate(library.get("gemm"), torch.randn(K), b)
    with raises_argument(r"A must be a tensor of shape \(..., K\), got list"):
        cc.evaluate(library.get("gemm"), [[1.0]], b)
    with raises_argument(r"B must be a 2-D tensor of shape \(N, K\) \(a Linear weight\), got shape \(1, 8, 4\)"):
        cc.evaluate(library.get("gemm"), a, b[None])
    with raises_argument(r"empty problem: M=0, N=8, K=4"):
        cc.evaluate(library.get("gemm"), torch.randn(0, K), b)
    with raises_argument(r"A is on cpu but B is on meta"):
        cc.evaluate(library.get("gemm"), a, b.to("meta"))
    with raises_argument(r"operand 'bias' is on meta but A is on cpu"):
        cc.evaluate(library.get("bias_gelu"), a, b, {"bias": torch.randn(N, device="meta")})


# --------------------------------------------------------------------------- pairwise ops need an even N
def test_pairwise_on_odd_n():
    a, b = ab(n=7)
    with raises_argument(r"gate pairs adjacent columns, but N=7 is odd: pairwise ops need an even N"):
        cc.evaluate(library.get("swiglu"), a, b)
    with raises_argument(r"N=7 is odd"):
        cc.evaluate(library.get("rope_qkv"), a, b, {"cos": torch.randn(2, 2), "sin": torch.randn(2, 2)})
    with raises_argument(r"operand 'vh' is N/2 wide but N=7 is odd: pairwise ops need an even N"):
        cc.evaluate(every_kind, a, b, {**good_operands(n=7), "vh": torch.randn(3)})


def test_segment_must_divide_the_columns():
    a, b = ab(n=24)
    with raises_argument(r"row_sumsq\(acc, segment=128\): 24 columns are not a whole number of segments of 128"):
        cc.evaluate(library.get("qk_rmsnorm"), a, b, {"gamma": torch.randn(24)})
    with raises_argument(r"row_max\(pairs\(acc\)\[0\], segment=5\): 12 columns are not a whole number of "
                         r"segments of 5"):
        cc.evaluate(trace(lambda acc: cc.pairs(acc)[1] - cc.row_max(cc.pairs(acc)[0], segment=5)), a, b)


# --------------------------------------------------------------------------- types of values
def test_unsupported_cast_targets():
    for target in (torch.int8, "int8", torch.float64, torch.int32, "fp8"):
        with raises_program(rf"dtype {re.escape(repr(target))} is not supported for casts and outputs; "
                            r"expected bf16, f16, f32 or input_dtype"):
            trace(lambda acc: acc.to(target))


def test_width_mismatch_between_values():
    def half_plus_acc(acc):
        x0, x1 = cc.pairs(acc)
        return acc + x0

    with raises_program(r"add\(acc, pairs\(acc\)\[0\]\): operands live in different column spaces \(acc is N wide, "
                        r"pairs\(acc\)\[0\] is N/2 wide\)"):
        trace(half_plus_acc)

    def colvec_half(acc, vh: cc.ColVec["N/2"]):
        return acc * vh

    with raises_program(r"mul\(acc, vh\): .*acc is N wide, vh is N/2 wide.*"
                        r"pairs\(\) halves the width, interleave\(\) doubles it"):
        trace(colvec_half)

    def wide_tile(acc, t2: cc.Tile["2N"]):
        return cc.where(acc > 0, t2, acc)

    with raises_program(r"where\(.*\): operands live in different column spaces"):
        trace(wide_tile)


def test_pairs_needs_an_n_or_2n_wide_value():
    def pairs_of_half(acc):
        x0, _ = cc.pairs(acc)
        return cc.pairs(x0)[0]

    with raises_program(r"pairs\(pairs\(acc\)\[0\]\): the value is N/2 wide; pairs\(\) takes an N-wide value"):
        trace(pairs_of_half)

    def pairs_of_row(acc, r: cc.RowVec):
        return acc * cc.pairs(r)[0]

    with raises_program(r"pairs\(r\): the value is row-constant wide"):
        trace(pairs_of_row)


def test_interleave_of_2n_values():
    def interleave_wide(acc, t2: cc.Tile["2N"]):
        return cc.interleave(t2, t2)

    with raises_program(r"interleave\(t2, t2\): values are 2N wide; interleave\(\) takes N/2- or N-wide values"):
        trace(interleave_wide)

    def interleave_rows(acc, r: cc.RowVec):
        return cc.interleave(r, 1.0) + acc

    with raises_program(r"interleave\(r, 1.0\): values are row-constant wide"):
        trace(interleave_rows)
    with raises_program(r"interleave\(\) takes numbers, not comparisons"):
        trace(lambda acc: cc.interleave(acc > 0, acc))
    with raises_program(r"interleave\(.*\): operands live in different column spaces"):
        trace(lambda acc: cc.interleave(acc, cc.pairs(acc)[0]))


def test_bool_used_as_number():
    with raises_program(r"add\(acc, \(acc > 0\)\): a comparison result \(bool\) cannot be used as a number; "
                        r"use where\(...\)"):
        trace(lambda acc: acc + (acc > 0))
    with raises_program(r"a comparison result \(bool\) cannot be used as a number"):
        trace(lambda acc: cc.exp(acc < 1.0))
    with raises_program(r"a comparison result \(bool\) cannot be used as a number"):
        trace(lambda acc: cc.where(acc > 0, acc > 1, acc))
    with raises_program(r"output 'D' = \(acc > 0\) is bool; outputs must be numbers \(use where"):
        trace(lambda acc: acc > 0)
    with raises_program(r"cannot cast comparison \(acc > 0\) to bf16; use where"):
        trace(lambda acc: (acc > 0).to(cc.bf16))
    with raises_program(r"boolean constants are not supported; use a comparison"):
        trace(lambda acc: acc + True)
    with raises_program(r"where\(acc, acc, 0.0\): where\(\) needs a comparison as its first argument"):
        trace(lambda acc: cc.where(acc, acc, 0.0))
    with raises_program(r"and_\(acc, \(acc > 0\)\): logical ops take comparison results \(bool\)"):
        trace(lambda acc: cc.where(acc & (acc > 0), acc, 0.0))
    with raises_program(r"not_\(acc\): logical ops take comparison results"):
        trace(lambda acc: cc.where(~acc, acc, 0.0))


def test_integer_only_ops_on_floats():
    with raises_program(r"mod\(acc, 2\): '%' is defined on integers \(coordinates\) only"):
        trace(lambda acc: acc % 2)
    with raises_program(r"floordiv\(acc.*'//' is defined on integers \(coordinates\) only"):
        trace(lambda acc: (acc // 2))
    with raises_program(r"output 'D' = \(col\[N\] \+ 1\) is i32; outputs must be numbers .*\.to\(f32\) for integers"):
        trace(lambda acc: acc.col + 1)


def test_truth_value_of_an_expression():
    def branchy(acc):
        if acc > 0:
            return acc
        return -acc

    with raises_program(r"an epilogue value has no truth value while the program is traced: "
                        r"use cc.where\(cond, a, b\)"):
        trace(branchy)
    with raises_program(r"no truth value"):
        trace(lambda acc: acc and acc)
    with raises_program(r"no truth value"):
        trace(lambda acc: acc if acc.row < 2 else -acc)


def test_other_expression_errors():
    with raises_program(r"x \*\* 3: only x \*\* 2 is supported"):
        trace(lambda acc: acc**3)
    with raises_program(r"x \*\* 0.5: only x \*\* 2"):
        trace(lambda acc: acc**0.5)
    with raises_program(r"r is the same along a row, so it has no column index"):
        trace(_col_of_row)
    with raises_program(r"cannot use Tensor tensor\(1.\) in an epilogue program: "
                        r"expected a Python int or float constant"):
        trace(lambda acc: acc + torch.tensor(1.0))
    with raises_program(r"cannot use str 'x' in an epilogue program"):
        trace(lambda acc: acc + "x")
    with raises_program(r"cannot use complex"):
        trace(lambda acc: acc * 1j)
    with raises_program(r"RowVec has no width to choose"):
        cc.RowVec["N"]
    with raises_program(r"Scalar has no width to choose"):
        cc.Scalar["N/2"]
    with raises_program(r"width '3N' is not one of 'N/2', 'N', '2N'"):
        cc.Tile["3N"]
    with raises_program(r"width 2 is not one of"):
        cc.ColVec[2]


def _col_of_row(acc, r: cc.RowVec):
    return acc + r.col


# --------------------------------------------------------------------------- reductions
def test_reduction_used_as_an_input_to_later_nodes():
    uses = {
        "add": lambda acc, red: acc + red,
        "radd": lambda acc, red: red + acc,
        "mul": lambda acc, red: 2.0 * red,
        "div": lambda acc, red: acc / red,
        "neg": lambda acc, red: -red,
        "compare": lambda acc, red: cc.where(acc > red, acc, 0.0),
        "exp": lambda acc, red: cc.exp(red),
        "where": lambda acc, red: cc.where(acc > 0, red, acc),
        "interleave": lambda acc, red: cc.interleave(red, acc),
        "pairs": lambda acc, red: cc.pairs(red)[0],
        "segment": lambda acc, red: cc.row_sum(red, segment=2),
        "clamp": lambda acc, red: cc.clamp(acc, hi=red),
        "abs": lambda acc, red: abs(red),
        "pow": lambda acc, red: red**2,
        "eq": lambda acc, red: cc.where(red == 0, acc, 1.0),  # not silently False
        "ne": lambda acc, red: cc.where(red != acc, acc, 1.0),
        "cast": lambda acc, red: red.to(cc.bf16),
        "truth": lambda acc, red: acc if red else -acc,  # not silently True
        "floordiv": lambda acc, red: red // 2,
        "mod": lambda acc, red: red % 2,
        "and": lambda acc, red: cc.where(red & (acc > 0), acc, 1.0),
        "invert": lambda acc, red: cc.where(~red, acc, 1.0),
    }
    for what, use in uses.items():
        for make in (cc.row_sum, cc.col_max, lambda x: cc.reduce(x, "logsumexp", "row")):
            with raises_program(r"is written as per-tile partials and finished after the kernel, so it can only be an "
                                r"output; to use a per-row value inside the program, reduce over a column segment"):
                trace(lambda acc: use(acc, make(acc)), name=what)


def test_bad_reduction_kind_axis_and_segment():
    with raises_program(r"cannot reduce over axis 'k': expected 'row' \(one value per row\) or "
                        r"'col' \(one value per column\)"):
        trace(lambda acc: {"s": cc.reduce(acc, "sum", axis="k")})
    with raises_program(r"reduction 'mean' is not one of \('sum', 'sumsq', 'max', 'maxabs', 'logsumexp'\)"):
        trace(lambda acc: {"s": cc.reduce(acc, "mean", "row")})
    with raises_program(r"col_sum: segment= is only defined for per-row reductions"):
        trace(lambda acc: acc - cc.reduce(acc, "sum", "col", segment=4))
    for bad in (0, -4, True, 2.0, "4"):
        with raises_program(rf"row_sum\(\.\.\., segment={re.escape(repr(bad))}\): "
                            r"segment must be a positive int \(columns\)"):
            trace(lambda acc: acc - cc.row_sum(acc, segment=bad))
    with raises_program(r"row_max\(r, segment=4\): needs a column-varying number"):
        trace(_segment_of_row)
    with raises_program(r"row_sum\(\(acc > 0\)\): cannot reduce a comparison"):
        trace(lambda acc: {"s": cc.row_sum(acc > 0)})
    with raises_program(r"row_sum\(\(acc > 0\), segment=2\): needs a column-varying number"):
        trace(lambda acc: acc - cc.row_sum(acc > 0, segment=2))


def _segment_of_row(acc, r: cc.RowVec):
    return acc - cc.row_max(r, segment=4)


def test_reduction_of_a_row_constant_value():
    with raises_program(r"output 's' = r is the same along every row, so its width is undefined"):
        trace(_row_sum_of_row)


def _row_sum_of_row(acc, r: cc.RowVec):
    return {"D": acc, "s": cc.row_sum(r)}


# --------------------------------------------------------------------------- outputs
def test_output_never_written():
    with raises_program(r"output 'D' is never written: its value is None, expected an expression"):
        trace(lambda acc: {"D": None})
    with raises_program(r"output 'E' is never written: its value is 1.5, expected an expression"):
        trace(lambda acc: {"D": acc, "E": 1.5})


def test_program_without_outputs():
    with raises_program(r"program 'prog' writes no outputs: return an expression or a dict of them"):
        trace(lambda acc: {})
    with raises_program(r"program 'prog' returned NoneType; return an expression \(stored as D\) or a dict"):
        trace(lambda acc: None)
    with raises_program(r"program 'prog' returned tuple"):
        trace(lambda acc: (acc, acc))


def test_row_constant_outputs():
    def rstd_out(acc, rstd: cc.RowVec):
        return {"D": rstd}

    with raises_program(r"output 'D' = rstd is the same along every row, so its width is undefined; combine it with a "
                        r"column-varying value such as acc"):
        trace(rstd_out)

    def scalar_math(acc, s: cc.Scalar):
        return cc.exp(s) * 2.0

    with raises_program(r"output 'D' = \(exp\(s\) \* 2.0\) is the same along every row"):
        trace(scalar_math)
    with raises_program(r"output 'D' = maximum\(1.0, 0.0\) is the same along every row"):
        trace(lambda acc: cc.clamp(1.0, 0.0))
    with raises_program(r"output 'D' = row.to\(f32\) is the same along every row"):
        trace(lambda acc: acc.row.to(cc.f32))


def test_output_name_clashes_with_operand():
    def clash(acc, bias: cc.ColVec):
        return {"bias": acc + bias}

    with raises_program(r"output 'bias' has the same name as an operand"):
        trace(clash)


# --------------------------------------------------------------------------- names
BAD_NAMES = [
    "x'); import os; ('", 'x"); __import__("os").system("true"); ("', "a'b", 'a"b', "a\nb", "D\n", "a\\b", "a.b", "a b",
    " a", "a-b", "", "1abc", "_x", "__init__", "__class__", "é", "a" * 49, "x;y", "a{b}", "a#b",
]
KEYWORDS = ["class", "def", "return", "import", "lambda", "None", "True", "match", "case", "_"]


@pytest.mark.parametrize("name", BAD_NAMES + KEYWORDS)
def test_unsafe_output_names(name):
    kind = "a Python keyword" if name in KEYWORDS and name != "_" else "not a safe identifier"
    with raises_program(rf"output name {re.escape(repr(name))} is {kind}"):
        trace(lambda acc: {name: acc})


@pytest.mark.parametrize("name", BAD_NAMES + KEYWORDS)
def test_unsafe_program_names(name):
    kind = "a Python keyword" if name in KEYWORDS and name != "_" else "not a safe identifier"
    with raises_program(rf"program name {re.escape(repr(name))} is {kind}"):
        Program(name, [], [Output("D", Node("acc", width=Fraction(1)))])
    if name:  # (an empty name= means "use the function's name")
        with raises_program(rf"program name {re.escape(repr(name))} is {kind}"):
            trace(lambda acc: acc, name=name)


@pytest.mark.parametrize("name", BAD_NAMES + KEYWORDS)
def test_unsafe_operand_names_in_a_program(name):
    kind = "a Python keyword" if name in KEYWORDS and name != "_" else "not a safe identifier"
    node = Node("load", (), (name,), "f32", Fraction(1))
    with raises_program(rf"operand name {re.escape(repr(name))} is {kind}"):
        Program("prog", [Operand(name, "col", Fraction(1))], [Output("D", node)])


def test_unsafe_operand_parameter_names():
    def private(acc, _bias: cc.ColVec):
        return acc + _bias

    with raises_program(r"operand name '_bias' is not a safe identifier"):
        trace(private)

    def soft_keyword(acc, match: cc.ColVec):
        return acc + match

    with raises_program(r"operand name 'match' is a Python keyword"):
        trace(soft_keyword)


@pytest.mark.parametrize("name", ["D__tensor", "x__part", "lse__max", "a__b"])
def test_double_underscores_are_kept_for_the_kernels_own_names(name):
    with raises_program(rf"output name '{name}' contains '__', which the emitted kernel keeps for the names it "
                        r"derives from yours \(tma_out_D__tensor\); use single underscores"):
        trace(lambda acc: {"D": acc, name: acc * 2.0})

    node = Node("load", (), (name,), "f32", Fraction(1))
    with raises_program(rf"operand name '{name}' contains '__'"):
        Program("prog", [Operand(name, "col", Fraction(1))], [Output("D", node)])


def test_non_string_names():
    with raises_program(r"output name 3 is not a safe identifier"):
        trace(lambda acc: {3: acc})
    with raises_program(r"program name None is not a safe identifier"):
        Program(None, [], [Output("D", Node("acc", width=Fraction(1)))])
    assert cc.epilogue(lambda acc: acc, name="a" * 48).name == "a" * 48


def test_lambda_needs_a_name():
    with raises_program(r"program name '<lambda>' is not a safe identifier"):
        cc.epilogue(lambda acc: acc)


def test_program_built_directly_is_validated():
    acc = Node("acc", width=Fraction(1))
    load = Node("load", (), ("ghost",), "f32", Fraction(1))
    with raises_program(r"node 'ghost' reads unknown operand 'ghost'; declared operands: none"):
        Program("p", [], [Output("D", load)])
    with raises_program(r"operand 'x': unknown kind 'matrix'"):
        Program("p", [Operand("x", "matrix")], [Output("D", acc)])
    with raises_program(r"operand 'x' is declared twice"):
        Program("p", [Operand("x", "row"), Operand("x", "col", Fraction(1))], [Output("D", acc)])
    with raises_program(r"output 'D' has the same name as an output"):
        Program("p", [], [Output("D", acc), Output("D", acc)])
    with raises_program(r"output 'D': dtype 'int8' is not one of \('f32', 'bf16', 'f16', 'in'\)"):
        Program("p", [], [Output("D", acc, "int8")])
    with raises_program(r"node 'load' is 4\*N wide; values are N/2, N or 2N wide"):
        Program("p", [], [Output("D", Node("load", (), ("t",), "f32", Fraction(4)))])
    with raises_program(r"output 's': reduction 'mean' is not one of"):
        Program("p", [], [Output("s", acc, None, "mean", "row")])
    with raises_program(r"output 's': cannot reduce over axis 'k'; expected 'row'"):
        Program("p", [], [Output("s", acc, None, "sum", "k")])


# --------------------------------------------------------------------------- constants
def test_nan_constants_are_rejected():
    with raises_program(r"constant NaN is not allowed in an epilogue program"):
        trace(lambda acc: acc + math.nan)
    with raises_program(r"constant NaN is not allowed"):
        trace(lambda acc: cc.where(acc > float("nan"), acc, 0.0))
    with raises_program(r"constant NaN is not allowed"):
        library.get("qk_rmsnorm").with_constants(eps=math.nan)
    with raises_program(r"constant NaN is not allowed"):
        cc.epilogue(eps=math.nan)(library.get("qk_rmsnorm").fn)


def test_inf_constants_are_accepted_and_canonical_json_stays_valid():
    def masked(acc, *, floor=-math.inf):
        return {"D": cc.where(acc.col < 3, acc, floor), "top": cc.row_max(cc.minimum(acc, math.inf))}

    prog = trace(masked)

    def no_bare_constants(token):
        raise AssertionError(f"canonical form contains non-JSON constant {token}")

    doc = json.loads(prog.canonical(), parse_constant=no_bare_constants)
    consts = [n[2][0] for n in doc["nodes"] if n[0] == "const"]
    assert {"f": "-inf"} in consts and {"f": "inf"} in consts
    assert "Infinity" not in prog.canonical() and "NaN" not in prog.canonical()
    variant = prog.with_constants(floor=math.inf)
    json.loads(variant.canonical(), parse_constant=no_bare_constants)
    assert variant.fingerprint != prog.fingerprint


def test_ints_outside_int32():
    with raises_program(r"integer constant 2147483648 does not fit in int32"):
        trace(lambda acc: acc + 2**31)
    with raises_program(r"integer constant -2147483649 does not fit in int32"):
        trace(lambda acc: acc * (-(2**31) - 1))
    with raises_program(r"integer constant 1099511627776 does not fit in int32"):
        library.get("qk_rmsnorm").with_constants(head_dim=2**40)
    trace(lambda acc: acc + (2**31 - 1) + (-(2**31)))  # the int32 range itself is fine


def test_bad_compile_time_constants():
    with raises_program(r"boolean constants are not supported"):
        library.get("rope_qkv").with_constants(rotary_cols=True)
    with raises_program(r"program 'qk_rmsnorm' has no compile-time constant\(s\) \['epsilon'\]; "
                        r"it has \['eps', 'head_dim'\]"):
        library.get("qk_rmsnorm").with_constants(epsilon=1e-5)
    with raises_program(r"program 'swiglu' has no compile-time constant\(s\) \['eps'\]; it has \[\]"):
        library.get("swiglu").with_constants(eps=1e-5)
    with raises_program(r"cannot use NoneType None in an epilogue program"):
        library.get("qk_rmsnorm").with_constants(eps=None)


# --------------------------------------------------------------------------- signatures
def test_unsupported_or_missing_annotation():
    def no_annotation(acc, bias):
        return acc + bias

    with raises_program(r"program 'prog': parameter 'bias' needs an operand annotation "
                        r"\(cc.RowVec, cc.ColVec, cc.Tile, cc.Scalar, cc.Table or cc.KVec\), got none"):
        trace(no_annotation)

    def torch_annotation(acc, bias: torch.Tensor):
        return acc + bias

    with raises_program(r"parameter 'bias' needs an operand annotation .*got <class 'torch.Tensor'>"):
        trace(torch_annotation)

    def float_annotation(acc, s: float):
        return acc * s

    with raises_program(r"parameter 's' needs an operand annotation .*got <class 'float'>"):
        trace(float_annotation)

    def unresolvable(acc, bias: "NoSuchKind"):  # noqa: F821
        return acc + bias

    with raises_program(r"program 'prog': cannot resolve parameter annotations \(name 'NoSuchKind' is not defined\)"):
        trace(unresolvable)


def test_star_args_and_kwargs():
    def star(acc, *extra):
        return acc

    with raises_program(r"program 'prog': \*args/\*\*kwargs are not supported \(parameter 'extra'\)"):
        trace(star)

    def double_star(acc, **extra):
        return acc

    with raises_program(r"\*args/\*\*kwargs are not supported \(parameter 'extra'\)"):
        trace(double_star)


def test_accumulator_parameter_and_constant_defaults():
    def no_params():
        return None

    with raises_program(r"program 'prog': the first parameter must receive the accumulator, e.g. def prog\(acc, ...\)"):
        trace(no_params)

    def keyword_acc(*, acc=None):
        return acc

    with raises_program(r"the first parameter must receive the accumulator"):
        trace(keyword_acc)

    def no_default(acc, *, eps):
        return acc + eps

    with raises_program(r"keyword-only parameter 'eps' needs a default \(it is a compile-time constant\)"):
        trace(no_default)


# --------------------------------------------------------------------------- index operands
def test_vectors_of_indices_must_hold_every_index_exactly():
    """A RowVec compared with `.col` (class targets) in bf16 is exact only up to 256: above that it
    is refused, naming the operand; float32 is exact below 2^24, int32 always."""
    program = library.get("cross_entropy_stats")
    a = torch.randn(4, 8)
    for n, dtype, ok in [(256, torch.bfloat16, True), (264, torch.bfloat16, False), (2048, torch.float16, True),
                         (2056, torch.float16, False), (4096, torch.float32, True), (4096, torch.int32, True)]:
        target = torch.tensor([0, 3, n - 1, -1], dtype=dtype)
        call = lambda: cc.evaluate(program, a, torch.randn(n, 8), {"target": target})  # noqa: E731
        if ok:
            call()
        else:
            with raises_argument(rf"operand 'target' \({dtype}\) is compared with col indices up to {n - 1}, but "
                                 rf"{dtype} holds integers exactly only up to"):
                call()
    with raises_argument(r"operand 'bias' has dtype torch.int32; expected .* \(int32 for vectors the program "
                         r"compares with .row or .col\)"):
        cc.evaluate(library.get("bias_gelu"), a, torch.randn(16, 8), {"bias": torch.zeros(16, dtype=torch.int32)})


def test_int32_indices_are_compared_exactly_in_the_reference():
    """Indices past 2^24 (as a class index of a vocabulary that large would be): float32 rounds
    2^24 + 1 to 2^24, int32 does not."""
    @cc.epilogue
    def picks(acc, index: cc.ColVec):
        return cc.where(acc.col + 16777216 == index, 1.0, 0.0)

    a, b = torch.randn(2, 8), torch.randn(4, 8)
    index = torch.full((4,), 16777216 + 1, dtype=torch.int32)  # every column asks for column 1
    exact = cc.evaluate(picks, a, b, {"index": index}).outputs["D"]
    assert exact.tolist() == [[0.0, 1.0, 0.0, 0.0]] * 2
    rounded = cc.evaluate(picks, a, b, {"index": index.float()}).outputs["D"]
    assert rounded.tolist() == [[1.0, 1.0, 0.0, 0.0]] * 2, "float32 cannot tell 2^24 + 1 from 2^24"

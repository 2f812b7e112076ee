"""The primitives' registry against its consumers: every elementwise op and every operand kind
defined in ``coda_cute/primitives.py`` is spelled by the frontend, typed by the program, run by
the reference interpreter, lowered, and documented; and each op's CuTe code computes what its
torch reference does.  A new entry that some consumer cannot handle fails here."""

from __future__ import annotations

import ast
import inspect
import math
import re
import string
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import coda_cute as cc
from coda_cute import frontend, primitives
from coda_cute.config import KernelConfig
from coda_cute.errors import ArgumentError
from coda_cute.library import resource_dir
from coda_cute.lower import lower
from coda_cute.primitives import A_TRANSFORMS, ELEMENTWISE, OPERAND_KINDS, STAGINGS, TYPINGS, WIDTHS, width_str
from coda_cute.program import Node, Output, Program, make_const, make_elementwise

OPS = list(ELEMENTWISE.values())
KINDS = list(OPERAND_KINDS.values())
README = (Path(__file__).resolve().parent.parent / "README.md").read_text()
ACC = Node("acc", width=Fraction(1))


def test_primitives_sit_at_the_bottom_of_the_package():
    """Every layer reads the registry, so it may import nothing of the package but its errors."""
    tree = ast.parse(Path(primitives.__file__).read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level}
    assert imported <= {"errors"}


# --------------------------------------------------------------------------- elementwise ops
def arguments(op) -> list[Node]:
    """Arguments of the types ``op`` takes, built from the accumulator and its coordinates."""
    compare = make_elementwise("gt", [ACC, make_const(0.5)])
    if op.typing == "int":
        return [Node("col", (), (), "i32", Fraction(1)), make_const(3)][: op.arity]
    if op.typing == "logic":
        return [compare, make_elementwise("lt", [ACC, make_const(2.0)])][: op.arity]
    if op.typing == "select":
        return [compare, ACC, make_const(0.0)]
    return [ACC, make_elementwise("mul", [ACC, make_const(0.5)])][: op.arity]


def program_using(op) -> Program:
    """A program whose output is ``op`` of ``arguments(op)`` (made a number if it is not)."""
    node = make_elementwise(op.name, arguments(op))
    if node.dtype == "bool":
        node = make_elementwise("where", [node, ACC, make_const(0.0)])
    elif node.dtype == "i32":
        node = make_elementwise("add", [ACC, node])
    return Program(f"uses_{op.name}", [], [Output("D", node, "f32")])


@pytest.mark.parametrize("op", OPS, ids=[op.name for op in OPS])
def test_op_entry_is_complete(op):
    assert op.typing in TYPINGS
    assert op.arity == len(op.args) >= 1 and op.cute
    assert {f for _, f, _, _ in string.Formatter().parse(op.cute) if f is not None} <= {*map(str, range(op.arity)), "t"}
    assert op.derivative is None or callable(op.derivative)


@pytest.mark.parametrize("op", OPS, ids=[op.name for op in OPS])
def test_frontend_spells_every_op(op):
    x, y, cond = cc.Expr(ACC), cc.Expr(make_elementwise("mul", [ACC, make_const(0.5)])), cc.Expr(ACC) > 0.0
    if op.typing == "int":
        x, y = cc.Expr(ACC).col, 3
    elif op.typing == "logic":
        x, y = cond, cond
    if op.operator:  # x + y, -(x), abs(x), ~(x) ...
        text = f"x {op.operator} y" if op.arity == 2 else f"{op.operator}(x)"
        built = eval(text, {}, {"x": x, "y": y})
        assert op.name not in frontend.__all__
    else:
        function = getattr(cc, op.name)
        assert op.name in frontend.__all__ and function.__doc__ == op.doc and op.doc
        assert list(inspect.signature(function).parameters) == list(op.args)
        built = function(*([cond, x, y] if op.typing == "select" else [x, y][: op.arity]))
    assert built.node.op == op.name


@pytest.mark.parametrize("op", OPS, ids=[op.name for op in OPS])
def test_reference_runs_every_op(op):
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(8, 16, generator=gen), torch.randn(12, 16, generator=gen)
    result = cc.evaluate(program_using(op), a, b)
    assert result.outputs["D"].shape == (8, 12) and result.outputs["D"].dtype == torch.float32
    if op.typing in ("arith", "float"):
        acc = result.acc
        expected = op.reference(*[acc, acc * 0.5][: op.arity])
        torch.testing.assert_close(result.outputs["D"], expected.float(), rtol=0, atol=0, equal_nan=True)


def _template_helpers() -> dict[str, str]:
    """Module-level functions the kernel templates define, by name: their source."""
    text = "\n".join(path.read_text() for path in sorted(resource_dir("templates").rglob("*.j2")))
    return {m.group(1): m.group(0) for m in re.finditer(r"^def (\w+)\(.*?(?=^\S)", text, re.M | re.S)}


def _code_pattern(code: str) -> str:
    """A regex matching ``code`` with any lane values in its ``{k}`` fields (the same one for a
    field used twice) and any CuTe type in ``{t}``."""
    pattern, seen = "", set()
    for literal, field, _, _ in string.Formatter().parse(code):
        pattern += re.escape(literal)
        if field == "t":
            pattern += r"cutlass\.\w+"
        elif field is not None:
            pattern += f"(?P=a{field})" if field in seen else f"(?P<a{field}>.+?)"
            seen.add(field)
    return pattern


@pytest.mark.parametrize("op", OPS, ids=[op.name for op in OPS])
def test_lowering_emits_every_op(op):
    ctx = lower(program_using(op), KernelConfig())
    pattern = re.compile(rf"\w+ = {_code_pattern(op.cute)}")
    assert any(pattern.fullmatch(line) for line in ctx.body), ctx.body
    assert set(op.helpers) <= ctx.helpers
    assert set(op.helpers) <= set(_template_helpers()), "a helper the CuTe code calls is missing from the template"


@pytest.mark.parametrize("op", [op for op in OPS if not op.operator], ids=lambda op: op.name)
def test_readme_lists_every_function(op):
    listing = re.search(r"^- elementwise math:(.*?)^- ", README, re.M | re.S).group(1)
    assert re.search(rf"\b{op.name}\b", listing), f"README's list of elementwise math lacks {op.name}"


# --------------------------------------------------------------------------- CuTe code vs torch reference
class CInt(int):
    """An int32 value with C's (and the GPU's) truncating division and remainder."""

    def __add__(self, o): return CInt(int(self) + int(o))
    def __sub__(self, o): return CInt(int(self) - int(o))
    def __mul__(self, o): return CInt(int(self) * int(o))
    def __neg__(self): return CInt(-int(self))

    def __floordiv__(self, o):
        q = abs(int(self)) // abs(int(o))
        return CInt(q if (self < 0) == (o < 0) else -q)

    def __mod__(self, o):
        return CInt(int(self) - int(o) * int(self // o))


def _emulated_dsl() -> dict:
    """Stand-ins for the names the CuTe code uses, on numpy float64 / bool and CInt scalars,
    with the template's helpers (``sigmoid``) defined from their source."""
    with_fastmath = lambda f: lambda x, fastmath=False: f(x)  # noqa: E731
    # min / max: NaN-propagating where asked (IEEE minimum), else as minNum (NaN ignored)
    def min_max(nan, num):
        return lambda x, y, propagate_nan=False, ftz=False: (nan if propagate_nan else num)(x, y)
    cute_math = SimpleNamespace(min=min_max(np.minimum, np.fmin), max=min_max(np.maximum, np.fmax), abs=abs,
                                exp=with_fastmath(np.exp), exp2=with_fastmath(np.exp2), log=with_fastmath(np.log),
                                sqrt=lambda x, approx=False, ftz=False: np.sqrt(x), rsqrt=lambda x: 1.0 / np.sqrt(x),
                                tanh=np.tanh, erf=math.erf, rcp=lambda x, approx=False, ftz=False: 1.0 / x,
                                div=lambda x, y, full=False, approx=False, ftz=False: x / y)
    names = {"cute": SimpleNamespace(math=cute_math),
             "cutlass": SimpleNamespace(Float32=np.float64, Int32=CInt, select_=lambda c, a, b: a if c else b)}
    helpers = _template_helpers()
    for name in {name for op in OPS for name in op.helpers}:
        exec(helpers[name], names)
    return names


def _samples(op, count: int, rng: np.random.Generator) -> list[tuple]:
    floats = lambda: float(rng.uniform(-3.0, 3.0))  # noqa: E731
    if op.typing == "int":
        return [(int(rng.integers(-20, 21)), int(rng.choice([-7, -3, -2, 2, 3, 5, 8]))) for _ in range(count)]
    if op.typing == "logic":
        return [tuple(bool(rng.integers(2)) for _ in op.args) for _ in range(count)]
    if op.typing == "select":
        return [(bool(rng.integers(2)), floats(), floats()) for _ in range(count)]
    # floats, and a NaN in each argument: ops that propagate NaN in torch must in the kernel too
    nans = [tuple(float("nan") if k == j else floats() for k in range(len(op.args))) for j in range(len(op.args))]
    return [tuple(floats() for _ in op.args) for _ in range(count)] + nans


@pytest.mark.parametrize("op", OPS, ids=[op.name for op in OPS])
def test_cute_code_computes_the_reference(op):
    """The op's CuTe code, run on Python scalars standing in for lane values (C integer
    semantics), agrees with its torch reference: the kernel and the reference compute one op."""
    names, rng = _emulated_dsl(), np.random.default_rng(0)
    dtypes = {bool: torch.bool, int: torch.int32, float: torch.float32}
    lanes = {bool: np.bool_, int: CInt, float: np.float64}
    result_type = "cutlass.Int32" if op.typing == "int" else "cutlass.Float32"
    for sample in _samples(op, 64, rng):
        values = [lanes[type(v)](v) for v in sample]
        with np.errstate(all="ignore"):
            got = eval(op.cute.format(*(f"v{k}" for k in range(op.arity)), t=result_type), names,
                       {f"v{k}": v for k, v in enumerate(values)})
        expected = op.reference(*[torch.tensor(v, dtype=dtypes[type(v)]) for v in sample])
        if expected.dtype == torch.bool:
            assert bool(got) == bool(expected), (op.name, sample)
        else:
            both_nan = math.isnan(got) and math.isnan(expected)  # outside the op's domain
            assert both_nan or math.isclose(got, expected, rel_tol=2e-6, abs_tol=1e-6), (op.name, sample, got)


@pytest.mark.parametrize("transform", list(A_TRANSFORMS.values()), ids=list(A_TRANSFORMS))
def test_a_transform_cute_code_computes_the_reference(transform):
    """An A transform's CuTe code (the mainloop's, on one element; ``lse`` scaled to log2 units as
    the template loads it) agrees with its torch reference, on the class that is the target and
    on others."""
    names, rng = _emulated_dsl(), np.random.default_rng(0)
    names["LOG2_E"] = 1.4426950408889634
    assert transform.operands == ("lse", "target", "dloss")  # the sampling below
    for _ in range(64):
        a, lse, dloss = (float(rng.uniform(-6.0, 6.0)) for _ in range(3))
        target, cls = (int(v) for v in rng.integers(0, 3, 2))
        code = transform.cute.format(a="a", cls="cls", lse="lse2", target="target", dloss="dloss")
        got = eval(code, names, dict(a=np.float64(a), cls=CInt(cls), lse2=np.float64(lse * names["LOG2_E"]),
                                     target=CInt(target), dloss=np.float64(dloss)))
        expected = transform.reference(torch.tensor(a), torch.tensor(cls), torch.tensor(lse), torch.tensor(target),
                                       torch.tensor(dloss))
        assert math.isclose(got, expected.item(), rel_tol=1e-5, abs_tol=1e-6), (a, cls, lse, target, dloss)


# --------------------------------------------------------------------------- operand kinds
def _widths(kind) -> list:
    return [None] if kind.width is None else list(WIDTHS)


# the kinds an epilogue reads (a KVec is read by an A transform only: tests/test_a_transform.py)
CASES = [(kind, width) for kind in KINDS if kind.staging != "transform" for width in _widths(kind)]
CASE_IDS = [f"{kind.name}-{width_str(width)}" for kind, width in CASES]


def program_reading(kind, width) -> Program:
    """A traced program that reads one operand ``x`` of ``kind`` and ``width``, combined with acc."""
    annotation = getattr(cc, kind.annotation)
    if width != kind.width:
        annotation = annotation[width_str(width)]

    def body(acc, x):
        if width == Fraction(1, 2):
            x = cc.interleave(x, x)
        elif width == Fraction(2):
            x = sum(cc.pairs(x))
        return acc + x

    positional = inspect.Parameter.POSITIONAL_OR_KEYWORD
    body.__signature__ = inspect.Signature([inspect.Parameter("acc", positional),
                                            inspect.Parameter("x", positional, annotation=annotation)])
    body.__annotations__ = {"x": annotation}
    return cc.epilogue(body, name=f"reads_{kind.name}")


def value_of(kind, width, m: int, n: int, gen):
    """A call's argument for an operand of ``kind`` (sizes from its ``dims``)."""
    if not kind.is_tensor:
        return 0.75
    sizes = {"M": m, "W": None if width is None else int(n * width), "R": 3, "P": 4}
    return torch.randn(*[sizes[d] for d in kind.dims], generator=gen)


@pytest.mark.parametrize("kind", KINDS, ids=[kind.name for kind in KINDS])
def test_kind_entry_is_complete(kind):
    assert OPERAND_KINDS[kind.name] is kind and kind.staging in STAGINGS
    assert set(kind.dims) <= {"M", "W", "R", "P", "K"} and ("W" in kind.dims) <= (kind.width is not None)
    assert ("K" in kind.dims) == (kind.staging == "transform")  # indices of K: only A transforms see them
    assert kind.annotation in frontend.__all__ and getattr(cc, kind.annotation).kind == kind.name


@pytest.mark.parametrize("kind,width", CASES, ids=CASE_IDS)
def test_every_kind_traces_binds_evaluates_and_lowers(kind, width):
    program = program_reading(kind, width)
    assert program.operands[0].kind == kind.name and program.operands[0].width == width
    assert kind.describe(width) in program.describe()
    gen = torch.Generator().manual_seed(0)
    m, n = 8, 16
    a, b = torch.randn(m, 32, generator=gen), torch.randn(n, 32, generator=gen)
    value = value_of(kind, width, m, n, gen)
    assert cc.evaluate(program, a, b, {"x": value}).outputs["D"].shape == (m, n)
    with pytest.raises(ArgumentError, match="'x'"):
        cc.evaluate(program, a, b, {"x": value[None] if kind.is_tensor else "0.75"})
    ctx = lower(program, KernelConfig())
    assert "in_x" in [p["name"] for p in ctx.host_params]


@pytest.mark.parametrize("kind,width", CASES, ids=CASE_IDS)
def test_every_kind_has_a_fake_argument(kind, width):
    pytest.importorskip("cutlass")
    from coda_cute.compile import fake_arguments

    args = fake_arguments(program_reading(kind, width), KernelConfig())
    assert len(args) == 4  # a, b, D, x

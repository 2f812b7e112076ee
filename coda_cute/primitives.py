"""The language's primitives, one definition each: elementwise ops and operand kinds.

Every consumer of a program reads these tables instead of keeping its own: the frontend
(the ``cc.<op>`` functions and the operand annotations), the program's validation and
listing, argument binding, the reference interpreter, fake-argument compilation and the
lowering.  Adding an elementwise op is one ``ElementwiseOp`` entry here (plus its test and
its line in the README); ``tests/test_registry.py`` fails if a consumer cannot handle an
entry.

This module sits at the bottom of the package: it imports nothing from it but the errors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable

import torch
import torch.nn.functional as F

from .errors import ArgumentError

# --------------------------------------------------------------------------- column spaces
#: Column spaces a value may live in, as multiples of N: one value per column pair of the
#: accumulator, per accumulator column, or two per accumulator column.
WIDTHS = (Fraction(1, 2), Fraction(1), Fraction(2))


def width_str(width: Fraction | None) -> str:
    """'N/2', 'N', '2N' or 'row-constant' (for error messages and listings)."""
    if width is None:
        return "row-constant"
    return {Fraction(1, 2): "N/2", Fraction(1): "N", Fraction(2): "2N"}.get(width, f"{width}*N")


# --------------------------------------------------------------------------- elementwise ops
#: How an op's result type follows from its arguments' (``program.make_elementwise`` applies these).
TYPINGS = {
    "arith": "integers stay integers, else f32",
    "float": "numbers in, always f32",
    "int": "integers (coordinates) only",
    "compare": "numbers in, bool out",
    "logic": "bools in, bool out",
    "select": "where(bool, a, b): the promoted type of a and b",
}


@dataclass(frozen=True)
class ElementwiseOp:
    """One elementwise op: everything each consumer needs to know about it.

    ``reference`` computes it with torch on fp32 / int32 / bool tensors (the reference
    interpreter).  ``cute`` is its CuTe-DSL code on scalar lane values ``{0}``, ``{1}``...,
    with ``{t}`` the CuTe type of the result; ``helpers`` are the template's helper functions
    that code calls; ``cute_int``, where given, is the code instead when the result is an int32
    (it calls no helper).  ``operator`` is the Python operator that spells it on program values
    (binary ops are shown infix in listings); an op without one is the frontend function
    ``cc.<name>``, documented by ``doc``.  ``keeps_zero``: the result is exactly 0 when every
    argument is 0 (lowering skips masking padding columns then).  ``derivative`` is its rule for
    backward derivation (``derive.py``): ``rule(g, args, y, cc)``, see the rules above.
    """

    name: str
    args: tuple[str, ...]
    typing: str
    reference: Callable
    cute: str
    operator: str = ""
    helpers: tuple[str, ...] = ()
    cute_int: str = ""
    keeps_zero: bool = False
    doc: str = ""
    derivative: Callable | None = None  # None: the result carries no gradient (NO_GRADIENT typings)

    @property
    def arity(self) -> int:
        return len(self.args)


def _real(x: torch.Tensor) -> torch.Tensor:
    """x as a floating tensor: integers (coordinates) become fp32, fp32 and fp64 stay."""
    return x if x.is_floating_point() else x.float()


# Derivative rules (read by derive.py): rule(g, args, y, cc) -> one gradient per argument (None:
# none), where g is the gradient of the result y, args and y are program values, and cc is the
# language (coda_cute.frontend) for the functions a rule calls.  Conventions are torch's.
def _d_min_max(smaller: bool):
    def rule(g, args, y, cc):
        a, b = args
        a_wins, b_wins = (a < b, b < a) if smaller else (a > b, b > a)
        tie = cc.where(a == b, 0.5 * g, 0.0)  # ties split the gradient in halves
        return cc.where(a_wins, g, tie), cc.where(b_wins, g, tie)
    return rule


def _d_gelu(g, args, y, cc):
    """Phi(x) + x phi(x): the normal distribution's CDF (by erf, no division) and density."""
    (x,) = args
    cdf = 0.5 + 0.5 * cc.erf(x * 0.7071067811865476)
    return (g * (cdf + x * cc.exp(-0.5 * x * x) * 0.3989422804014327),)


def _d_gelu_tanh(g, args, y, cc):
    """s + x s (1 - s) 2 z'(x), with s = sigmoid(2 z) = 0.5 (1 + tanh(z)), z = 0.79788 (x + 0.044715 x^3)."""
    (x,) = args
    s = cc.sigmoid(1.5957691216057308 * (x + 0.044715 * x * x * x))
    return (g * (s + x * s * (1.0 - s) * 1.5957691216057308 * (1.0 + 3.0 * 0.044715 * x * x)),)


def _d_silu(g, args, y, cc):
    (x,) = args
    s = cc.sigmoid(x)
    return (g * (s * (1.0 + x * (1.0 - s))),)


_X, _XY = ("x",), ("x", "y")
ELEMENTWISE: dict[str, ElementwiseOp] = {op.name: op for op in [
    ElementwiseOp("add", _XY, "arith", torch.add, "{0} + {1}", operator="+", keeps_zero=True,
                  derivative=lambda g, a, y, cc: (g, g)),
    ElementwiseOp("sub", _XY, "arith", torch.sub, "{0} - {1}", operator="-", keeps_zero=True,
                  derivative=lambda g, a, y, cc: (g, -g)),
    ElementwiseOp("mul", _XY, "arith", torch.mul, "{0} * {1}", operator="*", keeps_zero=True,
                  derivative=lambda g, a, y, cc: (g * a[1], g * a[0])),
    ElementwiseOp("div", _XY, "float", lambda x, y: torch.div(_real(x), _real(y)), "divide({0}, {1})", operator="/",
                  helpers=("divide",),
                  derivative=lambda g, a, y, cc: (g / a[1], -(g * y) / a[1])),
    ElementwiseOp("floordiv", _XY, "int", lambda x, y: torch.div(x, y, rounding_mode="floor"),
                  "({0} - ((({0} % {1}) + {1}) % {1})) // {1}", operator="//"),  # floor semantics, as in Python
    ElementwiseOp("mod", _XY, "int", torch.remainder, "(({0} % {1}) + {1}) % {1}", operator="%"),
    ElementwiseOp("minimum", _XY, "arith", torch.minimum, "minimum({0}, {1})", helpers=("minimum",),
                  cute_int="cute.math.min({0}, {1})", keeps_zero=True,
                  doc="The smaller of x and y, elementwise.",
                  derivative=_d_min_max(smaller=True)),
    ElementwiseOp("maximum", _XY, "arith", torch.maximum, "maximum({0}, {1})", helpers=("maximum",),
                  cute_int="cute.math.max({0}, {1})", keeps_zero=True,
                  doc="The larger of x and y, elementwise.",
                  derivative=_d_min_max(smaller=False)),
    ElementwiseOp("neg", _X, "arith", torch.neg, "-{0}", operator="-", keeps_zero=True,
                  derivative=lambda g, a, y, cc: (-g,)),
    ElementwiseOp("abs", _X, "arith", torch.abs, "cute.math.abs({0})", operator="abs", keeps_zero=True,
                  derivative=lambda g, a, y, cc: (cc.where(a[0] > 0.0, g, cc.where(a[0] < 0.0, -g, 0.0)),)),
    ElementwiseOp("square", _X, "arith", torch.square, "{0} * {0}", keeps_zero=True, doc="x * x (also x ** 2).",
                  derivative=lambda g, a, y, cc: (2.0 * a[0] * g,)),
    ElementwiseOp("exp", _X, "float", lambda x: torch.exp(_real(x)), "cute.math.exp({0}, fastmath=True)",
                  doc="e ** x.",
                  derivative=lambda g, a, y, cc: (g * y,)),
    ElementwiseOp("log", _X, "float", lambda x: torch.log(_real(x)), "cute.math.log({0}, fastmath=True)",
                  doc="Natural logarithm.",
                  derivative=lambda g, a, y, cc: (g / a[0],)),
    ElementwiseOp("sqrt", _X, "float", lambda x: torch.sqrt(_real(x)), "cute.math.sqrt({0}, approx=True)",
                  doc="Square root.",
                  derivative=lambda g, a, y, cc: (0.5 * g / y,)),
    ElementwiseOp("rsqrt", _X, "float", lambda x: torch.rsqrt(_real(x)), "cute.math.rsqrt({0})",
                  doc="1 / sqrt(x).",
                  derivative=lambda g, a, y, cc: (-0.5 * g * y * y * y,)),
    ElementwiseOp("tanh", _X, "float", lambda x: torch.tanh(_real(x)), "cute.math.tanh({0})",
                  doc="Hyperbolic tangent.",
                  derivative=lambda g, a, y, cc: (g * (1.0 - y * y),)),
    ElementwiseOp("sigmoid", _X, "float", lambda x: torch.sigmoid(_real(x)), "sigmoid({0})", helpers=("sigmoid",),
                  doc="1 / (1 + exp(-x)).",
                  derivative=lambda g, a, y, cc: (g * y * (1.0 - y),)),
    ElementwiseOp("relu", _X, "float", lambda x: torch.relu(_real(x)), "maximum({0}, 0.0)",
                  helpers=("maximum",), keeps_zero=True,
                  doc="max(x, 0).",
                  derivative=lambda g, a, y, cc: (cc.where(a[0] > 0.0, g, 0.0),)),
    ElementwiseOp("erf", _X, "float", lambda x: torch.erf(_real(x)), "cute.math.erf({0})",
                  doc="The error function, as CUDA's math library computes it.",
                  derivative=lambda g, a, y, cc: (g * cc.exp(-(a[0] * a[0])) * 1.1283791670955126,)),
    ElementwiseOp("gelu", _X, "float", lambda x: F.gelu(_real(x)),
                  "0.5 * {0} * (1.0 + cute.math.erf({0} * 0.7071067811865476))",
                  doc="GELU, exact: x * Phi(x) with the normal distribution's CDF.",
                  derivative=_d_gelu),
    # 0.5 * (1 + tanh(z)) = sigmoid(2 z): the fast exp and reciprocal sigmoid uses, no tanh
    # polynomial, and no cancellation in GELU's negative tail (1 + tanh(z) near 0)
    ElementwiseOp("gelu_tanh", _X, "float", lambda x: F.gelu(_real(x), approximate="tanh"),
                  "{0} * sigmoid(1.5957691216057308 * ({0} + 0.044715 * {0} * {0} * {0}))", helpers=("sigmoid",),
                  doc="GELU, tanh approximation (PyTorch's approximate='tanh').",
                  derivative=_d_gelu_tanh),
    ElementwiseOp("silu", _X, "float", lambda x: F.silu(_real(x)), "{0} * sigmoid({0})", helpers=("sigmoid",),
                  doc="x * sigmoid(x).",
                  derivative=_d_silu),
    ElementwiseOp("lt", _XY, "compare", torch.lt, "{0} < {1}", operator="<"),
    ElementwiseOp("le", _XY, "compare", torch.le, "{0} <= {1}", operator="<="),
    ElementwiseOp("gt", _XY, "compare", torch.gt, "{0} > {1}", operator=">"),
    ElementwiseOp("ge", _XY, "compare", torch.ge, "{0} >= {1}", operator=">="),
    ElementwiseOp("eq", _XY, "compare", torch.eq, "{0} == {1}", operator="=="),
    ElementwiseOp("ne", _XY, "compare", torch.ne, "{0} != {1}", operator="!="),
    ElementwiseOp("and_", _XY, "logic", torch.logical_and, "{0} & {1}", operator="&"),
    ElementwiseOp("or_", _XY, "logic", torch.logical_or, "{0} | {1}", operator="|"),
    ElementwiseOp("not_", _X, "logic", torch.logical_not, "~{0}", operator="~"),
    ElementwiseOp("where", ("cond", "x", "y"), "select", torch.where, "{t}(cutlass.select_({0}, {1}, {2}))",
                  doc="x where cond holds, else y (cond: a comparison).",
                  derivative=lambda g, a, y, cc: (None, cc.where(a[0], g, 0.0), cc.where(a[0], 0.0, g))),
]}

COMPARISONS = tuple(name for name, op in ELEMENTWISE.items() if op.typing == "compare")
#: typings whose results carry no gradient: integers, comparisons, logic (every other op has a rule)
NO_GRADIENT = ("int", "compare", "logic")


# --------------------------------------------------------------------------- operand kinds
#: How the kernel brings an operand's values to the epilogue (lowering implements each once).
STAGINGS = {
    "argument": "a kernel argument, the same value everywhere",
    "vector": "the tile's slice copied into shared memory once per tile, read through a broadcast view",
    "ring": "subtiles brought by TMA through a shared-memory ring, a warp ahead of the epilogue",
    "gather": "read from global memory element by element, a subtile ahead (or staged in a ring)",
    "transform": "read from global memory by the A transform as the mainloop loads A; never by the epilogue",
}

_F32_MAX = 3.4028234663852886e38


class OperandKind:
    """One kind of operand (an input the epilogue reads besides the accumulator).

    ``name`` is how programs and fingerprints spell the kind; ``annotation`` the frontend's
    ``cc.<annotation>`` that declares it, ``width`` that annotation's column space (None: the
    same along a row, no width to choose).  ``dims`` is the tensor a call passes: 'M' one entry
    per row (leading batch dims allowed), 'W' one per column of the operand's width, 'R' and
    'P' any size; () for a Python float.  ``staging`` is one of ``STAGINGS``.
    ``holds_indices``: it may be int32 when the program compares it with ``.row`` / ``.col``.
    """

    name: str
    annotation: str
    width: Fraction | None = Fraction(1)
    dims: tuple[str, ...]
    staging: str
    holds_indices = False

    @property
    def is_tensor(self) -> bool:
        """Whether a call passes a tensor (else a Python float)."""
        return bool(self.dims)

    def shape(self, width: Fraction | None) -> str:
        """The tensor's shape in words, e.g. '(M, N/2)'."""
        dims = [width_str(width) if d == "W" else d for d in self.dims]
        return f"({dims[0]},)" if len(dims) == 1 else f"({', '.join(dims)})"

    def describe(self, width: Fraction | None) -> str:
        """What a listing says about an operand of this kind and width."""
        return self.shape(width)

    def bind(self, op, value, rows: int, cols: int | None, batch_shape: tuple):
        """``value`` (for a tensor kind: a tensor whose dtype and device are checked) checked
        against operand ``op``'s shape and normalized: leading batch dims flattened to ``rows``."""
        raise NotImplementedError

    def read(self, value, rows: int, cols: int | None, device) -> torch.Tensor:
        """The reference interpreter's view of a bound value, broadcastable to (rows, cols)."""
        raise NotImplementedError


class _RowVec(OperandKind):
    name = "row"
    annotation = "RowVec"
    width = None
    dims = ("M",)
    staging = "vector"
    holds_indices = True

    def bind(self, op, value, rows, cols, batch_shape):
        shape = tuple(value.shape)
        if shape not in ((rows,), batch_shape):
            raise ArgumentError(f"operand {op.name!r} is a RowVec: expected shape ({rows},) (one value per row), "
                                f"got {shape}")
        return value.reshape(rows)

    def read(self, value, rows, cols, device):
        return value[:, None]


class _ColVec(OperandKind):
    name = "col"
    annotation = "ColVec"
    dims = ("W",)
    staging = "vector"
    holds_indices = True

    def bind(self, op, value, rows, cols, batch_shape):
        shape = tuple(value.shape)
        if shape != (cols,):
            raise ArgumentError(f"operand {op.name!r} is a ColVec {width_str(op.width)} wide: expected shape "
                                f"({cols},), got {shape}")
        return value

    def read(self, value, rows, cols, device):
        return value[None, :]


class _Tile(OperandKind):
    name = "tile"
    annotation = "Tile"
    dims = ("M", "W")
    staging = "ring"

    def bind(self, op, value, rows, cols, batch_shape):
        shape = tuple(value.shape)
        if shape not in ((rows, cols), batch_shape + (cols,)):
            raise ArgumentError(f"operand {op.name!r} is a Tile {width_str(op.width)} wide: expected shape "
                                f"({rows}, {cols}), got {shape}")
        return value.reshape(rows, cols)

    def read(self, value, rows, cols, device):
        return value


class _Scalar(OperandKind):
    name = "scalar"
    annotation = "Scalar"
    width = None
    dims = ()
    staging = "argument"

    def describe(self, width):
        return "runtime float"

    def bind(self, op, value, rows, cols, batch_shape):
        return check_scalar(op, value)

    def read(self, value, rows, cols, device):
        return torch.tensor(value, dtype=torch.float32, device=device)


def check_scalar(op, value) -> float:
    """A Scalar operand's value as a float, or an ArgumentError.  Checked on every call, also of
    a compiled kernel: a scalar's value is not part of the kernel's signature."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ArgumentError(f"operand {op.name!r} is a Scalar: expected a Python float, got {type(value).__name__}")
    try:
        value = float(value)
    except OverflowError:
        raise ArgumentError(f"operand {op.name!r} is a Scalar read as float32; {value} does not fit") from None
    if math.isnan(value):
        raise ArgumentError(f"operand {op.name!r} is NaN; a Scalar must be a number (infinities are allowed)")
    if math.isfinite(value) and abs(value) > _F32_MAX:
        raise ArgumentError(f"operand {op.name!r} is a Scalar read as float32; {value!r} does not fit (pass "
                            "float('inf') for an infinity)")
    return value


class _Table(OperandKind):
    name = "table"
    annotation = "Table"
    dims = ("R", "P")
    staging = "gather"

    def describe(self, width):
        return f"{self.shape(width)}, read as T[row % R, col % P], col in {width_str(width)}"

    def bind(self, op, value, rows, cols, batch_shape):
        shape = tuple(value.shape)
        if value.dim() != 2 or min(shape) == 0:
            raise ArgumentError(f"operand {op.name!r} is a Table: expected a 2-D tensor (R, P), got shape {shape}")
        return value

    def read(self, value, rows, cols, device):
        r = torch.arange(rows, device=device) % value.shape[0]
        c = torch.arange(cols, device=device) % value.shape[1]
        return value[r[:, None], c[None, :]]


class _KVec(OperandKind):
    """One value per index of the GEMM's K dimension, read by an A transform (``A_TRANSFORMS``)
    as A is loaded: the LM head's weight gradient dW = dlogits.T @ h runs over the tokens along K."""

    name = "kvec"
    annotation = "KVec"
    width = None
    dims = ("K",)
    staging = "transform"
    holds_indices = True

    def describe(self, width):
        return "(K,), read by the A transform"

    def bind(self, op, value, rows, cols, batch_shape):  # cols: K, for this kind (arguments.bind)
        shape = tuple(value.shape)
        if shape != (cols,):
            raise ArgumentError(f"operand {op.name!r} is a KVec: expected shape ({cols},) (one value per index of "
                                f"K), got {shape}")
        return value

    def read(self, value, rows, cols, device):
        return value


OPERAND_KINDS: dict[str, OperandKind] = {kind.name: kind for kind in (_RowVec(), _ColVec(), _Tile(), _Scalar(), _Table(),
                                                                      _KVec())}


# --------------------------------------------------------------------------- A transforms
@dataclass(frozen=True)
class ATransform:
    """A fixed elementwise map applied to the GEMM's A operand in shared memory, after TMA has
    loaded a stage and before the WGMMAs read it: ``acc = f(A) @ B.T``, f(A) rounded to the input
    dtype.  Each element a = A[i, k] belongs to one token t and one class c: t = i, c = k when
    the program's ``operands`` are RowVecs (A is tokens x classes); t = k, c = i when they are
    KVecs (A is classes x tokens).  ``reference(a, c, *operand values at t)`` is the math on
    fp32 tensors; the templates implement it (sm90_mainloop.py.j2)."""

    name: str
    operands: tuple[str, ...]
    reference: Callable
    #: its CuTe-DSL code on one element: ``{a}`` (fp32), ``{cls}`` (int32) and each operand's value
    #: at the element's token, the ``log2`` operands' already in log2 units (times log2 e, as loaded)
    cute: str
    doc: str
    classes: str = ""  # the operand holding class indices (compared with the element's class, int32)
    log2: tuple[str, ...] = ()


def _softmax_gradient(a, cls, lse, target, dloss):
    return (torch.exp(a - lse) - (cls == target).to(a.dtype)) * dloss


A_TRANSFORMS: dict[str, ATransform] = {t.name: t for t in [
    ATransform("softmax_grad", ("lse", "target", "dloss"), _softmax_gradient,
               cute="(cute.math.exp2({a} * LOG2_E - {lse}, fastmath=True) - cutlass.select_({cls} == {target}, 1.0, 0.0))"
                    " * {dloss}", classes="target", log2=("lse",),
               doc="cross-entropy's gradient of stored logits a: (exp(a - lse[t]) - [c == target[t]]) * dloss[t] "
                   "(lse: the token's log-sum-exp; target: its class, int32, outside [0, classes) for none; "
                   "dloss: its loss's gradient)"),
]}


def annotations_text(prefix: str = "cc.", last: str = " or ") -> str:
    """The annotations listed for a message: 'cc.RowVec, cc.ColVec, cc.Tile, cc.Scalar or cc.Table'."""
    names = [prefix + kind.annotation for kind in OPERAND_KINDS.values()]
    return ", ".join(names[:-1]) + last + names[-1]

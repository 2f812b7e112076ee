"""The language's primitives, one definition each: the elementwise ops.

Every consumer of a program reads this table instead of keeping its own: the frontend
(the ``cc.<op>`` functions), the program's typing and listing, the reference interpreter
and the lowering.  Adding an elementwise op is one ``ElementwiseOp`` entry here (plus its
test and its line in the README).

This module sits at the bottom of the package: it imports nothing from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

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
    that code calls.  ``operator`` is the Python operator that spells it on program values
    (binary ops are shown infix in listings); an op without one is the frontend function
    ``cc.<name>``, documented by ``doc``.  ``keeps_zero``: the result is exactly 0 when every
    argument is 0 (lowering skips masking padding columns then).  ``derivative`` is the rule
    backward derivation will read; None until that exists.
    """

    name: str
    args: tuple[str, ...]
    typing: str
    reference: Callable
    cute: str
    operator: str = ""
    helpers: tuple[str, ...] = ()
    keeps_zero: bool = False
    doc: str = ""
    derivative: Callable | None = None

    @property
    def arity(self) -> int:
        return len(self.args)


_X, _XY = ("x",), ("x", "y")
ELEMENTWISE: dict[str, ElementwiseOp] = {op.name: op for op in [
    ElementwiseOp("add", _XY, "arith", torch.add, "{0} + {1}", operator="+", keeps_zero=True),
    ElementwiseOp("sub", _XY, "arith", torch.sub, "{0} - {1}", operator="-", keeps_zero=True),
    ElementwiseOp("mul", _XY, "arith", torch.mul, "{0} * {1}", operator="*", keeps_zero=True),
    ElementwiseOp("div", _XY, "float", lambda x, y: torch.div(x.float(), y.float()), "{0} / {1}", operator="/"),
    ElementwiseOp("floordiv", _XY, "int", lambda x, y: torch.div(x, y, rounding_mode="floor"),
                  "({0} - ((({0} % {1}) + {1}) % {1})) // {1}", operator="//"),  # floor semantics, as in Python
    ElementwiseOp("mod", _XY, "int", torch.remainder, "(({0} % {1}) + {1}) % {1}", operator="%"),
    ElementwiseOp("minimum", _XY, "arith", torch.minimum, "cute.math.min({0}, {1})", keeps_zero=True,
                  doc="The smaller of x and y, elementwise."),
    ElementwiseOp("maximum", _XY, "arith", torch.maximum, "cute.math.max({0}, {1})", keeps_zero=True,
                  doc="The larger of x and y, elementwise."),
    ElementwiseOp("neg", _X, "arith", torch.neg, "-{0}", operator="-", keeps_zero=True),
    ElementwiseOp("abs", _X, "arith", torch.abs, "cute.math.abs({0})", operator="abs", keeps_zero=True),
    ElementwiseOp("square", _X, "arith", torch.square, "{0} * {0}", keeps_zero=True, doc="x * x (also x ** 2)."),
    ElementwiseOp("exp", _X, "float", lambda x: torch.exp(x.float()), "cute.math.exp({0}, fastmath=True)",
                  doc="e ** x."),
    ElementwiseOp("log", _X, "float", lambda x: torch.log(x.float()), "cute.math.log({0}, fastmath=True)",
                  doc="Natural logarithm."),
    ElementwiseOp("sqrt", _X, "float", lambda x: torch.sqrt(x.float()), "cute.math.sqrt({0})", doc="Square root."),
    ElementwiseOp("rsqrt", _X, "float", lambda x: torch.rsqrt(x.float()), "cute.math.rsqrt({0})",
                  doc="1 / sqrt(x)."),
    ElementwiseOp("tanh", _X, "float", lambda x: torch.tanh(x.float()), "cute.math.tanh({0})",
                  doc="Hyperbolic tangent."),
    ElementwiseOp("sigmoid", _X, "float", lambda x: torch.sigmoid(x.float()), "sigmoid({0})", helpers=("sigmoid",),
                  doc="1 / (1 + exp(-x))."),
    ElementwiseOp("relu", _X, "float", lambda x: torch.relu(x.float()), "cute.math.max({0}, 0.0)", keeps_zero=True,
                  doc="max(x, 0)."),
    ElementwiseOp("gelu", _X, "float", lambda x: F.gelu(x.float()),
                  "0.5 * {0} * (1.0 + cute.math.erf({0} * 0.7071067811865476))",
                  doc="GELU, exact: x * Phi(x) with the normal distribution's CDF."),
    ElementwiseOp("gelu_tanh", _X, "float", lambda x: F.gelu(x.float(), approximate="tanh"),
                  "0.5 * {0} * (1.0 + cute.math.tanh(0.7978845608028654 * ({0} + 0.044715 * {0} * {0} * {0})))",
                  doc="GELU, tanh approximation (PyTorch's approximate='tanh')."),
    ElementwiseOp("silu", _X, "float", lambda x: F.silu(x.float()), "{0} * sigmoid({0})", helpers=("sigmoid",),
                  doc="x * sigmoid(x)."),
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
                  doc="x where cond holds, else y (cond: a comparison)."),
]}

COMPARISONS = tuple(name for name, op in ELEMENTWISE.items() if op.typing == "compare")

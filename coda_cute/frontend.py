"""How a user writes an epilogue program: a Python function of named operands.

    import coda_cute as cc

    @cc.epilogue
    def bias_gelu(acc, bias: cc.ColVec):
        return cc.gelu(acc + bias)

The decorator calls the function once with symbolic values (``Expr``) and records the
graph it builds as a ``Program``.  Parameter annotations say what each operand is:

- ``cc.RowVec``: one value per row (length M), e.g. 1/rms of each token;
- ``cc.ColVec``: one value per column (length N), e.g. a bias; ``cc.ColVec["N/2"]`` for a
  vector over the column pairs;
- ``cc.Tile``: a full M x N tensor, e.g. a residual; ``cc.Tile["2N"]`` is twice as wide;
- ``cc.Scalar``: a float given at call time;
- ``cc.Table``: a 2-D tensor T (R, P) read as T[row % R, col % P] (RoPE cos/sin tables).

Keyword-only parameters with defaults are compile-time constants
(``prog.with_constants(eps=1e-6)`` makes a variant).  The function returns one
expression (stored as output ``D``) or a dict of named outputs, which may include
reductions (``cc.row_sum(x)`` ...).  A tile output is stored in the GEMM inputs' dtype
unless its expression ends in ``.to(dtype)``.
"""

from __future__ import annotations

import inspect
import sys
import threading
import typing
from fractions import Fraction

from . import program as ir
from .errors import ProgramError
from .primitives import ELEMENTWISE, OPERAND_KINDS, ElementwiseOp, annotations_text

# storage dtypes, spelled like torch's; input_dtype = whatever the GEMM inputs are (bf16 or f16)
f32, bf16, f16, input_dtype = "f32", "bf16", "f16", "in"
_DTYPE_ALIASES = {"f32": f32, "float32": f32, "fp32": f32, "bf16": bf16, "bfloat16": bf16,
                  "f16": f16, "float16": f16, "fp16": f16, "half": f16, "in": input_dtype}


def _dtype_name(dtype: object) -> str:
    key = str(dtype).replace("torch.", "")
    if key not in _DTYPE_ALIASES:
        raise ProgramError(
            f"dtype {dtype!r} is not supported for casts and outputs; expected bf16, f16, f32 or input_dtype"
        )
    return _DTYPE_ALIASES[key]


class Expr:
    """A symbolic value of an epilogue program (wraps one ``program.Node``)."""

    __slots__ = ("node",)
    __hash__ = None  # == builds a comparison, as in torch

    def __init__(self, node: ir.Node):
        self.node = node
        _note_traced_frame()

    # arithmetic
    def __add__(self, o): return _call("add", self, o)
    def __radd__(self, o): return _call("add", o, self)
    def __sub__(self, o): return _call("sub", self, o)
    def __rsub__(self, o): return _call("sub", o, self)
    def __mul__(self, o): return _call("mul", self, o)
    def __rmul__(self, o): return _call("mul", o, self)
    def __truediv__(self, o): return _call("div", self, o)
    def __rtruediv__(self, o): return _call("div", o, self)
    def __floordiv__(self, o): return _call("floordiv", self, o)
    def __rfloordiv__(self, o): return _call("floordiv", o, self)
    def __mod__(self, o): return _call("mod", self, o)
    def __rmod__(self, o): return _call("mod", o, self)
    def __neg__(self): return _call("neg", self)
    def __abs__(self): return _call("abs", self)
    def __pow__(self, p):
        if p == 2:
            return _call("square", self)
        raise ProgramError(f"x ** {p!r}: only x ** 2 is supported; use exp/log/sqrt for other powers")
    # comparisons and logic
    def __lt__(self, o): return _call("lt", self, o)
    def __le__(self, o): return _call("le", self, o)
    def __gt__(self, o): return _call("gt", self, o)
    def __ge__(self, o): return _call("ge", self, o)
    def __eq__(self, o): return _call("eq", self, o)  # type: ignore[override]
    def __ne__(self, o): return _call("ne", self, o)  # type: ignore[override]
    def __and__(self, o): return _call("and_", self, o)
    def __or__(self, o): return _call("or_", self, o)
    def __invert__(self): return _call("not_", self)

    def __bool__(self):
        raise ProgramError(
            "an epilogue value has no truth value while the program is traced: "
            "use cc.where(cond, a, b) instead of if/and/or"
        )

    def to(self, dtype) -> "Expr":
        """Round to a storage dtype (bf16, f16, f32, input_dtype); as an output's last op, its stored dtype."""
        if self.node.dtype == "bool":
            raise ProgramError(f"cannot cast comparison {self.node.describe()} to {dtype}; use where(...)")
        return Expr(ir.Node("cast", (self.node,), (_dtype_name(dtype),), "f32", self.node.width))

    @property
    def row(self) -> "Expr":
        """Row index of each element (0..M-1)."""
        return Expr(ir.Node("row", (), (), "i32", None))

    @property
    def col(self) -> "Expr":
        """Column index of each element in this value's own column space."""
        if self.node.width is None:
            raise ProgramError(f"{self.node.describe()} is the same along a row, so it has no column index")
        return Expr(ir.Node("col", (), (), "i32", self.node.width))

    def __repr__(self) -> str:
        return f"Expr({self.node.describe()})"


def _node(x: object) -> ir.Node:
    if isinstance(x, Expr):
        return x.node
    if isinstance(x, Reduction):
        x._refuse()
    return ir.make_const(x)


def _call(op: str, *args) -> Expr:
    return Expr(ir.make_elementwise(op, [_node(a) for a in args]))


# ---------------------------------------------------------------- elementwise functions
def _function(op: ElementwiseOp) -> typing.Callable:
    """The frontend function ``cc.<name>`` of an elementwise op that no Python operator spells."""
    signature = inspect.Signature([inspect.Parameter(arg, inspect.Parameter.POSITIONAL_OR_KEYWORD) for arg in op.args])

    def function(*args, **kwargs) -> Expr:
        return _call(op.name, *signature.bind(*args, **kwargs).args)

    function.__name__ = function.__qualname__ = op.name
    function.__doc__, function.__signature__ = op.doc, signature
    return function


# cc.exp, cc.where ...: one function per elementwise op that no operator spells
_FUNCTIONS = [op.name for op in ELEMENTWISE.values() if not op.operator]
globals().update({name: _function(ELEMENTWISE[name]) for name in _FUNCTIONS})


def clamp(x, lo=None, hi=None):
    """min(max(x, lo), hi); either bound may be omitted."""
    if lo is not None:
        x = _call("maximum", x, lo)
    if hi is not None:
        x = _call("minimum", x, hi)
    return x if isinstance(x, Expr) else Expr(_node(x))


def pairs(x: Expr) -> tuple[Expr, Expr]:
    """Split columns into (even, odd) halves: column 2j and 2j+1 become column j of each.

    Over interleaved gate/up columns: ``gate, up = cc.pairs(acc)``.  Halves the width.
    """
    node = _node(x)
    if node.width not in (Fraction(1), Fraction(2)):
        raise ProgramError(
            f"pairs({node.describe()}): the value is {ir.width_str(node.width)} wide; pairs() takes an "
            "N-wide value (the accumulator) or a 2N-wide tile operand"
        )
    half = node.width / 2
    return tuple(Expr(ir.Node("pair", (node,), (k,), node.dtype, half)) for k in (0, 1))  # type: ignore[return-value]


def interleave(even, odd) -> Expr:
    """Inverse of pairs(): column j of ``even`` / ``odd`` become columns 2j / 2j+1.  Doubles the width."""
    a, b = _node(even), _node(odd)
    width = ir.join_widths([a, b], f"interleave({a.describe()}, {b.describe()})")
    if width not in (Fraction(1, 2), Fraction(1)):
        raise ProgramError(
            f"interleave({a.describe()}, {b.describe()}): values are {ir.width_str(width)} wide; "
            "interleave() takes N/2- or N-wide values"
        )
    if "bool" in (a.dtype, b.dtype):
        raise ProgramError("interleave() takes numbers, not comparisons")
    return Expr(ir.Node("interleave", (a, b), (), "f32" if "f32" in (a.dtype, b.dtype) else "i32", width * 2))


# ---------------------------------------------------------------- reductions
class Reduction:
    """A per-row or per-column reduction: an output only (partials finished after the kernel)."""

    def __init__(self, kind: str, axis: str, x):
        self.kind, self.axis, self.node = kind, axis, _node(x)
        if self.node.dtype == "bool":
            raise ProgramError(f"{axis}_{kind}({self.node.describe()}): cannot reduce a comparison")

    def _refuse(self, *_):
        raise ProgramError(
            f"{self.axis}_{self.kind}({self.node.describe()}) is written as per-tile partials and finished "
            "after the kernel, so it can only be an output; to use a per-row value inside the program, "
            "reduce over a column segment that fits in a tile: row_sum(x, segment=P)"
        )

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _refuse
    __truediv__ = __rtruediv__ = __neg__ = __lt__ = __gt__ = __le__ = __ge__ = _refuse
    # every other way of using it as a value must refuse too, not fall back to Python's
    # defaults (``r == 0`` would be False, ``if r:`` True, ``abs(r)`` a bare TypeError)
    __floordiv__ = __rfloordiv__ = __mod__ = __rmod__ = __pow__ = __rpow__ = __abs__ = _refuse
    __eq__ = __ne__ = __and__ = __rand__ = __or__ = __ror__ = __invert__ = __bool__ = to = _refuse
    __hash__ = None


def _reduce(kind: str, axis: str, x, segment):
    if segment is None:
        return Reduction(kind, axis, x)
    if axis != "row":
        raise ProgramError(f"col_{kind}: segment= is only defined for per-row reductions")
    if isinstance(segment, bool) or not isinstance(segment, int) or segment <= 0:
        raise ProgramError(f"row_{kind}(..., segment={segment!r}): segment must be a positive int (columns)")
    node = _node(x)
    if node.width is None or node.dtype == "bool":
        raise ProgramError(f"row_{kind}({node.describe()}, segment={segment}): needs a column-varying number")
    return Expr(ir.Node("segreduce", (node,), (kind, segment), "f32", node.width))


def row_sum(x, segment=None): return _reduce("sum", "row", x, segment)
def row_sumsq(x, segment=None): return _reduce("sumsq", "row", x, segment)
def row_max(x, segment=None): return _reduce("max", "row", x, segment)
def row_maxabs(x, segment=None): return _reduce("maxabs", "row", x, segment)
def row_logsumexp(x, segment=None): return _reduce("logsumexp", "row", x, segment)
def col_sum(x): return _reduce("sum", "col", x, None)
def col_sumsq(x): return _reduce("sumsq", "col", x, None)
def col_max(x): return _reduce("max", "col", x, None)
def col_maxabs(x): return _reduce("maxabs", "col", x, None)
def col_logsumexp(x): return _reduce("logsumexp", "col", x, None)


def reduce(x, kind: str, axis: str, segment=None):
    """General form of the row_*/col_* helpers: ``kind`` in program.REDUCTIONS, ``axis`` 'row' or 'col'."""
    if kind not in ir.REDUCTIONS:
        raise ProgramError(f"reduction {kind!r} is not one of {ir.REDUCTIONS}")
    if axis not in ir.REDUCE_AXES:
        raise ProgramError(
            f"cannot reduce over axis {axis!r}: expected 'row' (one value per row) or 'col' (one value per column)"
        )
    return _reduce(kind, axis, x, segment)


# ---------------------------------------------------------------- operand annotations
class OperandAnnotation:
    """Annotation for an epilogue parameter; subscript with a width: ``cc.Tile["2N"]``."""

    def __init__(self, kind: str, width: Fraction | None, label: str):
        self.kind, self.width, self.label = kind, width, label

    def __getitem__(self, width: str) -> "OperandAnnotation":
        if self.width is None:
            raise ProgramError(f"{self.label} has no width to choose")
        return OperandAnnotation(self.kind, ir.parse_width(width), f"{self.label}[{width!r}]")

    def __repr__(self) -> str:
        return f"coda_cute.{self.label}"


# cc.RowVec, cc.ColVec ...: one annotation per operand kind
_ANNOTATIONS = [kind.annotation for kind in OPERAND_KINDS.values()]
globals().update({kind.annotation: OperandAnnotation(kind.name, kind.width, kind.annotation)
                  for kind in OPERAND_KINDS.values()})


# ---------------------------------------------------------------- the decorator
#: module names under which ``library.resolve`` runs a user's file (not importable by that name)
FILE_MODULE_PREFIX = "coda_cute_file_"


class EpilogueFunction(ir.Program):
    """A Program traced from a Python function; keeps the function to re-trace variants."""

    def __init__(self, fn: typing.Callable, constants: dict, name: str, operands, outputs, origin: str | None,
                 a_transform: str | None = None):
        self.fn, self.constants = fn, dict(constants)
        super().__init__(name, operands, outputs, doc=inspect.getdoc(fn) or "", origin=origin, a_transform=a_transform)

    def with_constants(self, **values) -> "EpilogueFunction":
        """A variant of this program with some compile-time constants changed."""
        return _trace(self.fn, self.name, {**self.constants, **values}, origin=None, a_transform=self.a_transform)


def epilogue(fn=None, *, name: str | None = None, a_transform: str | None = None, **constants):
    """Trace ``fn(acc, operand: Kind, ..., *, const=default)`` into a validated Program.

    ``a_transform`` names a map applied to A before the product (``primitives.A_TRANSFORMS``,
    e.g. "softmax_grad"): ``acc = f(A) @ B.T``; its operands are parameters of ``fn`` by name."""
    if fn is None:
        return lambda f: epilogue(f, name=name, a_transform=a_transform, **constants)
    return _trace(fn, fn.__name__ if name is None else name, constants, origin=_origin(fn), a_transform=a_transform)


def _origin(fn) -> str | None:
    """Where the program traced from ``fn`` is found again (``library.resolve``): ``module:name``,
    or ``file.py:name`` for a script or a file the command line ran; None inside a function."""
    qualname, module = getattr(fn, "__qualname__", ""), getattr(fn, "__module__", None)
    if not qualname or "<" in qualname or not module:
        return None
    if module == "__main__" or module.startswith(FILE_MODULE_PREFIX):
        try:
            path = inspect.getsourcefile(fn)
        except TypeError:
            return None
        return f"{path}:{qualname}" if path else None
    return f"{module}:{qualname}"


def _trace(fn, name: str, overrides: dict, origin: str | None, a_transform: str | None = None) -> EpilogueFunction:
    sig = inspect.signature(fn)
    try:
        hints = typing.get_type_hints(fn)
    except Exception as exc:  # unresolvable string annotations
        raise ProgramError(f"program {name!r}: cannot resolve parameter annotations ({exc})") from None
    params = list(sig.parameters.values())
    if not params or params[0].kind not in (params[0].POSITIONAL_ONLY, params[0].POSITIONAL_OR_KEYWORD):
        raise ProgramError(f"program {name!r}: the first parameter must receive the accumulator, e.g. def {name}(acc, ...)")
    operands, args, consts = [], [Expr(ir.Node("acc", width=Fraction(1)))], {}
    for p in params[1:]:
        if p.kind == p.KEYWORD_ONLY:
            if p.default is p.empty:
                raise ProgramError(f"program {name!r}: keyword-only parameter {p.name!r} needs a default (it is a compile-time constant)")
            consts[p.name] = p.default
            continue
        if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            raise ProgramError(f"program {name!r}: *args/**kwargs are not supported (parameter {p.name!r})")
        kind = hints.get(p.name)
        if not isinstance(kind, OperandAnnotation):
            raise ProgramError(
                f"program {name!r}: parameter {p.name!r} needs an operand annotation "
                f"({annotations_text()}), got "
                f"{'none' if kind is None else repr(kind)}"
            )
        ir.check_name(p.name, "operand")
        operands.append(ir.Operand(p.name, kind.kind, kind.width))
        args.append(Expr(ir.Node("load", (), (p.name,), "f32", kind.width)))
    unknown = set(overrides) - set(consts)
    if unknown:
        raise ProgramError(f"program {name!r} has no compile-time constant(s) {sorted(unknown)}; it has {sorted(consts)}")
    consts.update(overrides)
    for key, value in consts.items():
        ir.make_const(value)  # same rules as inline constants (finite, int32...)

    result, local_names = _call_recording_locals(fn, args, consts)
    outputs = _collect_outputs(name, result)
    _name_values(local_names, [o.node for o in outputs])
    return EpilogueFunction(fn, consts, name, operands, outputs, origin, a_transform)


def _collect_outputs(name: str, result) -> list[ir.Output]:
    if isinstance(result, (Expr, Reduction)):
        result = {"D": result}
    if not isinstance(result, dict):
        raise ProgramError(
            f"program {name!r} returned {type(result).__name__}; return an expression (stored as D) "
            "or a dict {output name: expression or reduction}"
        )
    outputs = []
    for key, value in result.items():
        ir.check_name(key, "output")
        if isinstance(value, Reduction):
            outputs.append(ir.Output(key, value.node, None, value.kind, value.axis))
        elif isinstance(value, Expr):
            node = value.node
            dtype = node.attrs[0] if node.op == "cast" else None
            outputs.append(ir.Output(key, node, dtype))
        else:
            outputs.append(ir.Output(key, value))  # Program validation names the problem
    return outputs


_TRACE = threading.local()  # .code: the epilogue function being traced; .frame: its frame once seen


def _note_traced_frame() -> None:
    """Remember the traced function's frame when it builds a value (called from Expr()).

    Its locals are read after it returns (a finished frame keeps them), so no profiler or
    tracer hook is needed and one installed by the user (cProfile, a debugger) is left alone."""
    code = getattr(_TRACE, "code", None)
    if code is None or _TRACE.frame is not None:
        return
    frame = sys._getframe(2)
    while frame is not None and frame.f_code is not code:
        frame = frame.f_back
    _TRACE.frame = frame


def _call_recording_locals(fn, args, consts):
    """Call ``fn`` and keep its local variables at return: they name the program's values."""
    saved = getattr(_TRACE, "code", None), getattr(_TRACE, "frame", None)
    _TRACE.code, _TRACE.frame = fn.__code__, None
    try:
        result = fn(*args, **consts)
        frame = _TRACE.frame
        captured = dict(frame.f_locals) if frame is not None else {}
    finally:
        _TRACE.code, _TRACE.frame = saved
        frame = None  # no reference cycle through the finished frame
    return result, captured


def _name_values(local_names: dict, roots: list) -> None:
    """Attach the user's variable names to computed nodes (first name wins), as hints."""
    reachable = {id(n) for n in ir._walk([r for r in roots if isinstance(r, ir.Node)])}
    for var, value in local_names.items():
        if not isinstance(value, Expr) or id(value.node) not in reachable:
            continue
        node = value.node
        if node.hint or node.op in ("acc", "load", "const", "row", "col"):
            continue
        try:
            ir.check_name(var, "value")
        except ProgramError:
            continue
        object.__setattr__(node, "hint", var)


__all__ = [
    "Expr", "Reduction", *_ANNOTATIONS, "epilogue", "f32", "bf16", "f16", "input_dtype", *_FUNCTIONS, "clamp",
    "pairs", "interleave", "reduce", "row_sum", "row_sumsq", "row_max", "row_maxabs", "row_logsumexp",
    "col_sum", "col_sumsq", "col_max", "col_maxabs", "col_logsumexp",
]

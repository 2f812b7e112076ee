"""The validated epilogue program: a small DAG of typed nodes, shared by every consumer.

A program describes what happens to one GEMM output ``acc = A @ B.T`` (fp32, M x N)
before it leaves the chip.  Consumers: the reference interpreter (``reference.py``),
the code generator (``lower.py`` -> ``templates/``) and, later, backward derivation.

Every node carries three static facts, checked when the node is built:

- ``dtype``: ``"f32"``, ``"i32"`` (coordinates and integer constants) or ``"bool"``;
- ``width``: which column space the value lives in, as a multiple of N: ``1/2`` (one value
  per column pair of the accumulator), ``1`` (per accumulator column) or ``2`` (two values
  per accumulator column), or ``None`` for values that are the same along a row (scalars,
  per-row vectors, the row index);
- ``op`` and ``attrs``: what it computes (``primitives.ELEMENTWISE`` defines the elementwise ops).

Outputs are either tiles (stored with their own dtype) or reductions (per-tile partials,
finished after the kernel).  ``Program`` owns validation of the whole graph and its
fingerprint; per-call checks of tensor shapes live in ``arguments.py``.
"""

from __future__ import annotations

import hashlib
import json
import keyword
import math
import re
from dataclasses import dataclass, field
from fractions import Fraction

from .errors import ProgramError
from .primitives import A_TRANSFORMS, COMPARISONS, ELEMENTWISE, OPERAND_KINDS, WIDTHS, annotations_text, width_str

#: Bumped whenever the meaning of a serialized program changes.
IR_VERSION = 1

#: Dtypes a tile output or a rounding cast may name (storage dtypes); "in" is the GEMM
#: inputs' dtype, resolved when the program is bound to tensors.
STORAGE_DTYPES = ("f32", "bf16", "f16", "in")

# keywords, soft keywords included, spelled out so every Python version accepts the same names
_RESERVED = frozenset(keyword.kwlist) | {"match", "case", "type", "_"}
#: keyword parameters of a kernel call (``Kernel.__call__``) that an operand name would shadow
CALL_KEYWORDS = frozenset({"out", "return_partials"})
#: value types a node may have: numbers, coordinates and integer constants, comparison results
NODE_DTYPES = ("f32", "i32", "bool")
_NAME_RE = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,47}\Z")
_INT32 = (-(2**31), 2**31 - 1)


def parse_width(text: str | int | Fraction) -> Fraction:
    """Parse a user-facing width ('N', 'N/2', '2N') into a Fraction of N."""
    table = {"N": Fraction(1), "N/2": Fraction(1, 2), "2N": Fraction(2)}
    if isinstance(text, str) and text.replace(" ", "") in table:
        return table[text.replace(" ", "")]
    raise ProgramError(f"width {text!r} is not one of 'N/2', 'N', '2N'")


def check_name(name: object, what: str) -> str:
    """Reject names that could not appear verbatim in emitted Python source.

    Emitted code prefixes every user name (see ``lower.py``), so a valid name can never
    shadow a template variable; this check keeps quotes, newlines, dots and the like out.
    Names derived from one user name append ``__`` and a word (``tma_out_D__tensor``), so a
    user name may not contain ``__``: otherwise output ``D__tensor`` would be output ``D``'s.
    """
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ProgramError(
            f"{what} name {name!r} is not a safe identifier: expected a letter followed by "
            "up to 47 letters, digits or underscores"
        )
    if "__" in name:
        raise ProgramError(f"{what} name {name!r} contains '__', which the emitted kernel keeps for the names "
                           "it derives from yours (tma_out_D__tensor); use single underscores")
    if name in _RESERVED:
        raise ProgramError(f"{what} name {name!r} is a Python keyword; choose another name")
    if what == "operand" and name in CALL_KEYWORDS:
        raise ProgramError(f"operand name {name!r} is a keyword of the kernel call (kernel(a, b, out=..., "
                           "return_partials=..., **operands)); choose another name")
    return name


#: Reductions a program may ask for; each has an identity for padding partial tiles.
REDUCTIONS = ("sum", "sumsq", "max", "maxabs", "logsumexp")
REDUCE_AXES = ("row", "col")


# --------------------------------------------------------------------------- nodes
@dataclass(frozen=True, eq=False)
class Node:
    """One value of the program.  Compared by identity; ``key`` gives structure.

    ops: 'acc', 'load' (attrs: operand name), 'const' (attrs: value), 'row', 'col',
    'cast' (attrs: storage dtype), 'pair' (attrs: 0 even / 1 odd), 'interleave',
    'segreduce' (attrs: reduction kind, segment width), or an ``ELEMENTWISE`` name.
    """

    op: str
    args: tuple[Node, ...] = ()
    attrs: tuple = ()
    dtype: str = "f32"
    width: Fraction | None = None
    hint: str | None = field(default=None, compare=False)

    def describe(self) -> str:
        """The value's name if it has one, else a short math-like rendering."""
        return self.hint or self.expand()

    def expand(self) -> str:
        """A short math-like rendering of this node, with named sub-values shown by name."""
        return _render(self, depth=0)


def _render(node: Node, depth: int) -> str:
    if depth > 0 and node.hint:
        return node.hint
    if depth > 5 and node.args:
        return "..."
    a = [_render(x, depth + 1) for x in node.args]
    op = node.op
    if op == "acc":
        return "acc"
    if op == "load":
        return node.attrs[0]
    if op == "const":
        return repr(node.attrs[0])
    if op in ("row", "col"):
        return op if op == "row" else f"col[{width_str(node.width)}]"
    if op == "cast":
        return f"{a[0]}.to({node.attrs[0]})"
    if op == "pair":
        return f"pairs({a[0]})[{node.attrs[0]}]"
    if op == "interleave":
        return f"interleave({a[0]}, {a[1]})"
    if op == "segreduce":
        return f"row_{node.attrs[0]}({a[0]}, segment={node.attrs[1]})"
    info = ELEMENTWISE[op]
    if info.operator and len(a) == 2:
        return f"({a[0]} {info.operator} {a[1]})"
    return f"{op.rstrip('_')}({', '.join(a)})"


def _promote(nodes: list[Node], what: str) -> str:
    dtypes = {n.dtype for n in nodes}
    if "bool" in dtypes:
        raise ProgramError(f"{what}: a comparison result (bool) cannot be used as a number; use where(...)")
    return "i32" if dtypes == {"i32"} else "f32"


def join_widths(nodes: list[Node], what: str) -> Fraction | None:
    """The common column space of ``nodes`` (row-constant values broadcast into any)."""
    widths = {n.width for n in nodes if n.width is not None}
    if len(widths) > 1:
        shown = ", ".join(f"{n.describe()} is {width_str(n.width)} wide" for n in nodes if n.width is not None)
        raise ProgramError(
            f"{what}: operands live in different column spaces ({shown}); elementwise ops need "
            "values of the same width (pairs() halves the width, interleave() doubles it)"
        )
    return widths.pop() if widths else None


def make_elementwise(op: str, args: list[Node]) -> Node:
    """Build an elementwise node, checking its types and widths."""
    info = ELEMENTWISE[op]
    if len(args) != info.arity:
        raise ProgramError(f"{op} takes {info.arity} argument(s), got {len(args)}")
    what = f"{op}({', '.join(a.describe() for a in args)})"
    width = join_widths(args, what)
    if info.typing == "arith":
        dtype = _promote(args, what)
    elif info.typing == "float":
        _promote(args, what)
        dtype = "f32"
    elif info.typing == "int":
        if any(a.dtype != "i32" for a in args):
            raise ProgramError(f"{what}: '{info.operator}' is defined on integers (coordinates) only")
        dtype = "i32"
    elif info.typing == "compare":
        _promote(args, what)
        dtype = "bool"
    elif info.typing == "logic":
        if any(a.dtype != "bool" for a in args):
            raise ProgramError(f"{what}: logical ops take comparison results (bool)")
        dtype = "bool"
    else:  # select
        if args[0].dtype != "bool":
            raise ProgramError(f"{what}: where() needs a comparison as its first argument")
        dtype = _promote(args[1:], what)
    return Node(op, tuple(args), (), dtype, width)


def make_const(value: object) -> Node:
    """A compile-time constant.  NaN is rejected; infinities are allowed (masks, max)."""
    if isinstance(value, bool):
        raise ProgramError("boolean constants are not supported; use a comparison")
    if isinstance(value, int):
        if not _INT32[0] <= value <= _INT32[1]:
            raise ProgramError(f"integer constant {value} does not fit in int32")
        return Node("const", (), (value,), "i32", None)
    if isinstance(value, float):
        if math.isnan(value):
            raise ProgramError("constant NaN is not allowed in an epilogue program")
        return Node("const", (), (value,), "f32", None)
    raise ProgramError(
        f"cannot use {type(value).__name__} {value!r} in an epilogue program: expected a Python "
        f"int or float constant, or an operand declared as a parameter ({annotations_text('', ', ')})"
    )


# --------------------------------------------------------------------------- operands / outputs
@dataclass(frozen=True)
class Operand:
    """An input the epilogue reads besides the accumulator: its kind is one of
    ``primitives.OPERAND_KINDS`` ('row', 'col', 'tile', 'scalar', 'table'), its width the
    column space it lives in (None for kinds that are the same along a row)."""

    name: str
    kind: str
    width: Fraction | None = None

    @property
    def is_tensor(self) -> bool:
        """Whether a call passes a tensor for it (else a Python float)."""
        return OPERAND_KINDS[self.kind].is_tensor

    @property
    def staging(self) -> str:
        """How the kernel brings its values to the epilogue (``primitives.STAGINGS``)."""
        return OPERAND_KINDS[self.kind].staging

    def describe(self) -> str:
        return f"{self.name}: {self.kind} {OPERAND_KINDS[self.kind].describe(self.width)}"


@dataclass(frozen=True)
class Output:
    """A stored result: a tile (``dtype`` None = the GEMM inputs' dtype) or a reduction.

    Reductions (``reduce`` = kind, ``axis`` = 'row' for one value per row, 'col' for one
    value per column) are written as per-tile partials; see ``reference.py`` for the layout.
    """

    name: str
    node: Node
    dtype: str | None = None
    reduce: str | None = None
    axis: str | None = None

    @property
    def is_reduction(self) -> bool:
        return self.reduce is not None


# --------------------------------------------------------------------------- program
class Program:
    """A validated epilogue program.  Build one with ``@coda_cute.epilogue``."""

    def __init__(self, name: str, operands: list[Operand], outputs: list[Output], doc: str = "", *,
                 origin: str | None = None, derived_from: "Program | None" = None, a_transform: str | None = None):
        self.name = check_name(name, "program")
        # the map applied to A before the product (primitives.A_TRANSFORMS), or None
        self.a_transform = a_transform
        if not isinstance(doc, str):
            raise ProgramError(f"program {name!r}: its docstring must be a str, got {type(doc).__name__}")
        if origin is not None and not isinstance(origin, str) or not isinstance(derived_from, (Program, type(None))):
            raise ProgramError(f"program {name!r}: origin must be a str and derived_from a Program")
        self.operands = tuple(operands)
        self.outputs = tuple(outputs)
        self.doc = doc
        # where the program came from, for the command that regenerates its kernel (render.py);
        # neither is part of the fingerprint: the same program found two ways is one kernel
        self.origin = origin  # "module:name" or "file.py:name" of the function it was traced from
        self.derived_from = derived_from  # the forward program of a derived backward (derive.py)
        self.validate()
        self.nodes = self._toposort()
        self.fingerprint = hashlib.sha256(self.canonical().encode()).hexdigest()
        self._frozen = True

    def __setattr__(self, name: str, value) -> None:
        # the fingerprint (the cache key) and the validation describe the program as built
        if getattr(self, "_frozen", False):
            raise AttributeError(f"a Program cannot be changed after it is built ({name!r}); build a new one")
        super().__setattr__(name, value)

    # -- queries
    def operand(self, name: str) -> Operand:
        for op in self.operands:
            if op.name == name:
                return op
        raise KeyError(name)

    @property
    def tile_outputs(self) -> tuple[Output, ...]:
        return tuple(o for o in self.outputs if not o.is_reduction)

    @property
    def reductions(self) -> tuple[Output, ...]:
        return tuple(o for o in self.outputs if o.is_reduction)

    def uses(self, op: str) -> bool:
        return any(n.op == op for n in self.nodes)

    # -- validation
    def validate(self) -> None:
        """Raise ProgramError naming the first thing wrong with the program (done when it is built;
        rendering checks again, so no text reaches emitted source unchecked)."""
        seen: dict[str, str] = {}
        for op in self.operands:
            check_name(op.name, "operand")
            if not isinstance(op.kind, str) or op.kind not in OPERAND_KINDS:
                raise ProgramError(f"operand {op.name!r}: unknown kind {op.kind!r}")
            if (op.width is None) != (OPERAND_KINDS[op.kind].width is None) or (op.width is not None and op.width not in WIDTHS):
                raise ProgramError(
                    f"operand {op.name!r} ({op.kind}) has width {width_str(op.width)}; per-row vectors and scalars "
                    "have none, the others are N/2, N or 2N wide"
                )
            if op.name in seen:
                raise ProgramError(f"operand {op.name!r} is declared twice")
            seen[op.name] = "operand"
        if not self.outputs:
            raise ProgramError(f"program {self.name!r} writes no outputs: return an expression or a dict of them")
        for out in self.outputs:
            if not isinstance(out, Output):
                raise ProgramError(f"program {self.name!r}: outputs must be Output records, got {type(out).__name__}")
            check_name(out.name, "output")
            if out.name in seen:
                raise ProgramError(f"output {out.name!r} has the same name as an {seen[out.name]}")
            seen[out.name] = "output"
            if not isinstance(out.node, Node):
                raise ProgramError(f"output {out.name!r} is never written: its value is {out.node!r}, expected an expression")
        # every node, children first, so each check may rely on its arguments being sound
        operands = {op.name: op for op in self.operands}
        for node in _walk([o.node for o in self.outputs]):
            _check_node(node, operands)
            if node.op == "load" and operands[node.attrs[0]].kind == "kvec":
                raise ProgramError(f"operand {node.attrs[0]!r} is a KVec (one value per index of K): only an A "
                                   "transform reads it, the epilogue cannot")
        for out in self.outputs:
            self._validate_output(out)
        self._validate_a_transform(operands)

    def _validate_a_transform(self, operands: dict[str, Operand]) -> None:
        kvecs = [name for name, op in operands.items() if op.kind == "kvec"]
        if self.a_transform is None:
            if kvecs:
                raise ProgramError(f"program {self.name!r}: KVec operand(s) {kvecs} are read by an A transform, and "
                                   "the program has none (epilogue(a_transform=...))")
            return
        if not isinstance(self.a_transform, str) or self.a_transform not in A_TRANSFORMS:
            raise ProgramError(f"program {self.name!r}: A transform {self.a_transform!r} is unknown; known: "
                               f"{', '.join(A_TRANSFORMS)}")
        needs = A_TRANSFORMS[self.a_transform].operands
        missing = [name for name in needs if name not in operands]
        kinds = {operands[name].kind for name in needs if name in operands}
        if missing or len(kinds) != 1 or kinds - {"row", "kvec"}:
            raise ProgramError(
                f"program {self.name!r}: A transform {self.a_transform!r} reads operands {', '.join(needs)}, all "
                "RowVecs (a token per row of A) or all KVecs (a token per index of K)"
                + (f"; missing: {', '.join(missing)}" if missing else
                   f"; got {', '.join(f'{n}: {operands[n].kind}' for n in needs)}"))
        stray = sorted(set(kvecs) - set(needs))
        if stray:
            raise ProgramError(f"program {self.name!r}: KVec operand(s) {stray} are not read by A transform "
                               f"{self.a_transform!r} (it reads {', '.join(needs)})")

    @property
    def tokens_along(self) -> str | None:
        """Where an A transform finds each element's token: 'row' (A's row, RowVec operands) or
        'k' (A's index of K, KVec operands); None without a transform."""
        if self.a_transform is None:
            return None
        return "k" if self.operand(A_TRANSFORMS[self.a_transform].operands[0]).kind == "kvec" else "row"

    @property
    def a_major(self) -> str | None:
        """The major an A transform needs A in, so that a 16-byte vector of A holds one token's
        values: 'k' with a token per row of A, 'm' with a token per index of K; None without."""
        if self.a_transform is None:
            return None
        return "k" if self.tokens_along == "row" else "m"

    def _validate_output(self, out: Output) -> None:
        node = out.node
        if node.dtype != "f32":
            raise ProgramError(
                f"output {out.name!r} = {node.describe()} is {node.dtype}; outputs must be numbers "
                "(use where(...) to turn a comparison into values, or .to(f32) for integers)"
            )
        if node.width is None:
            raise ProgramError(
                f"output {out.name!r} = {node.describe()} is the same along every row, so its width "
                "is undefined; combine it with a column-varying value such as acc"
            )
        if out.reduce is None:
            if out.dtype is not None and out.dtype not in STORAGE_DTYPES:
                raise ProgramError(f"output {out.name!r}: dtype {out.dtype!r} is not one of {STORAGE_DTYPES}")
        else:
            if out.reduce not in REDUCTIONS:
                raise ProgramError(f"output {out.name!r}: reduction {out.reduce!r} is not one of {REDUCTIONS}")
            if out.axis not in REDUCE_AXES:
                raise ProgramError(
                    f"output {out.name!r}: cannot reduce over axis {out.axis!r}; expected 'row' "
                    "(one value per row, reduced over columns) or 'col' (one value per column)"
                )

    def _toposort(self) -> tuple[Node, ...]:
        return tuple(_walk([o.node for o in self.outputs]))

    # -- identity
    def canonical(self) -> str:
        """Deterministic JSON of everything that can change the emitted kernel."""
        index: dict[int, int] = {}
        nodes = []
        for node in self.nodes:
            index[id(node)] = len(nodes)
            nodes.append([node.op, [index[id(a)] for a in node.args], [_encode(v) for v in node.attrs],
                          node.dtype, _encode(node.width), node.hint])
        doc = {
            "ir": IR_VERSION,
            "name": self.name,
            "operands": [[o.name, o.kind, _encode(o.width)] for o in self.operands],
            "nodes": nodes,
            "outputs": [[o.name, index[id(o.node)], o.dtype, o.reduce, o.axis] for o in self.outputs],
        }
        if self.a_transform is not None:  # absent otherwise: programs without one keep their fingerprints
            doc["a_transform"] = self.a_transform
        return json.dumps(doc, separators=(",", ":"), sort_keys=True)

    def describe(self) -> str:
        """A listing of operands, named nodes and outputs (what `coda-cute show` prints)."""
        lines = [f"program {self.name}  (fingerprint {self.fingerprint[:16]})"]
        if self.doc:
            lines += ["  " + self.doc.strip().splitlines()[0]]
        if self.a_transform is not None:
            axis = "A's row" if self.tokens_along == "row" else "A's index of K"
            lines.append(f"A transform: acc = {self.a_transform}(A) @ B.T, a token per {axis}")
            lines.append(f"  {A_TRANSFORMS[self.a_transform].doc}")
        lines.append("operands:")
        lines += [f"  {op.describe()}" for op in self.operands] or ["  (accumulator only)"]
        lines.append("values:")
        for node in self.nodes:
            if node.hint:
                lines.append(f"  {node.hint} = {node.expand()}   [{node.dtype}, {width_str(node.width)}]")
        lines.append("outputs:")
        for out in self.outputs:
            if out.is_reduction:
                per = "per row (M,)" if out.axis == "row" else f"per column ({width_str(out.node.width)},)"
                lines.append(f"  {out.name} = {out.axis}_{out.reduce}({out.node.describe()})  {per}, fp32 partials")
            else:
                dt = out.dtype or "input dtype"
                lines.append(f"  {out.name} = {out.node.describe()}  tile (M, {width_str(out.node.width)}), {dt}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<coda_cute.Program {self.name} {self.fingerprint[:12]}>"


def _walk(roots: list[Node]) -> list[Node]:
    """Nodes reachable from ``roots`` in a deterministic post-order (children first).

    A hand-built node whose ``args`` are not a tuple of nodes is refused here, before anything
    reads its arguments."""
    order: list[Node] = []
    seen: set[int] = set()
    stack: list[tuple[Node, bool]] = [(r, False) for r in reversed(roots) if isinstance(r, Node)]
    while stack:
        node, expanded = stack.pop()
        if id(node) in seen:
            continue
        if expanded:
            seen.add(id(node))
            order.append(node)
        else:
            if not isinstance(node.args, tuple) or not all(isinstance(a, Node) for a in node.args):
                raise ProgramError(f"node with op {node.op!r}: its arguments must be a tuple of nodes, got {node.args!r}")
            stack.append((node, True))
            stack.extend((a, False) for a in reversed(node.args) if id(a) not in seen)
    return order


def reads_as_index(node: Node, arg: Node) -> bool:
    """Whether the comparison ``node`` reads its argument ``arg``, an operand's value, as an
    integer: the other side is an integer (a coordinate such as ``acc.col``).  An int32 operand
    is then compared as an integer, exactly, by every consumer (the kernel and the reference);
    everywhere else operand values are fp32."""
    return (node.op in COMPARISONS and arg.op == "load"
            and any(other.dtype == "i32" for other in node.args if other is not arg))


def index_operands(program: "Program") -> dict[str, tuple[tuple[str, Fraction | None], ...]]:
    """Row and column vectors compared with coordinates, by name: for each, the coordinates it is
    compared with, ('row', None) or ('col', width), or A's index of K, ('k', None), for the
    target of an A transform that runs over A's rows.  Such a vector holds indices (class targets),
    so its dtype must hold every index of that coordinate exactly (arguments.bind checks)."""
    found: dict[str, dict] = {}  # dicts as ordered sets: the program's order, no sort (torch.compile traces this)
    for node in program.nodes:
        for arg in node.args:
            if not reads_as_index(node, arg) or not OPERAND_KINDS[program.operand(arg.attrs[0]).kind].holds_indices:
                continue
            for other in node.args:
                for coord in _walk([other]) if other is not arg else ():
                    if coord.op in ("row", "col"):
                        found.setdefault(arg.attrs[0], {})[(coord.op, coord.width)] = None
    if program.a_transform is not None:  # its class indices: A's index of K, or its row
        classes = A_TRANSFORMS[program.a_transform].classes
        found.setdefault(classes, {})[("k", None) if program.tokens_along == "row" else ("row", None)] = None
    return {name: tuple(axes) for name, axes in found.items()}


#: ops that are not elementwise: how each value enters or changes column space
STRUCTURAL_OPS = ("acc", "load", "const", "row", "col", "cast", "pair", "interleave", "segreduce")


def _check_node(node: Node, operands: dict[str, Operand]) -> None:
    """Refuse a node the frontend could not have built: an unknown op, attributes of the wrong
    kind, a hint that is not a safe name, or a dtype / width other than its op gives.  Programs
    built by hand (``Program(...)`` of ``Node``s) pass through here like traced ones, so every
    consumer (lowering, the reference, the emitted source's comments) reads sound nodes only."""
    op = node.op
    if not isinstance(op, str) or (op not in STRUCTURAL_OPS and op not in ELEMENTWISE):
        raise ProgramError(f"node op {op!r} is unknown; expected one of {', '.join(STRUCTURAL_OPS)} or an "
                           f"elementwise op ({', '.join(ELEMENTWISE)})")
    if node.hint is not None:
        check_name(node.hint, "value")
    if node.dtype not in NODE_DTYPES:
        raise ProgramError(f"node {op!r} has dtype {node.dtype!r}; values are one of {NODE_DTYPES}")
    if node.width is not None and node.width not in WIDTHS:
        raise ProgramError(f"node {op!r} is {width_str(node.width)} wide; values are N/2, N or 2N wide "
                           "(or the same along a row)")
    if not isinstance(node.attrs, tuple):
        raise ProgramError(f"node {op!r}: attrs must be a tuple, got {node.attrs!r}")
    expected = _expected_type(node, operands)
    if (node.dtype, node.width) != expected:
        raise ProgramError(f"node {node.describe()}: dtype {node.dtype} and width {width_str(node.width)} do not "
                           f"follow from its op and arguments ({expected[0]}, {width_str(expected[1])})")


def _expected_type(node: Node, operands: dict[str, Operand]) -> tuple[str, Fraction | None]:
    """(dtype, width) that ``node``'s op and arguments give, checking its arity and attributes."""
    op, args, attrs = node.op, node.args, node.attrs
    if op in ELEMENTWISE:
        if attrs:
            raise ProgramError(f"node {op!r} takes no attributes, got {attrs!r}")
        built = make_elementwise(op, list(args))
        return built.dtype, built.width
    arity = {"cast": 1, "pair": 1, "segreduce": 1, "interleave": 2}.get(op, 0)
    if len(args) != arity:
        raise ProgramError(f"node {op!r} takes {arity} argument(s), got {len(args)}")
    if op == "acc":
        _expect_attrs(node, 0)
        return "f32", Fraction(1)
    if op == "load":
        _expect_attrs(node, 1)
        name = attrs[0]
        if name not in operands:
            raise ProgramError(f"node {name!r} reads unknown operand {name!r}; "
                               f"declared operands: {sorted(operands) or 'none'}")
        return "f32", operands[name].width
    if op == "const":
        _expect_attrs(node, 1)
        const = make_const(attrs[0])  # the same rules as constants in a traced function
        return const.dtype, None
    if op == "row":
        _expect_attrs(node, 0)
        return "i32", None
    if op == "col":
        _expect_attrs(node, 0)
        return "i32", node.width
    x = args[0]
    if op == "cast":
        _expect_attrs(node, 1)
        if attrs[0] not in STORAGE_DTYPES or x.dtype == "bool":
            raise ProgramError(f"cast of {x.describe()} to {attrs[0]!r}: expected a number cast to one of {STORAGE_DTYPES}")
        return "f32", x.width
    if op == "pair":
        _expect_attrs(node, 1)
        if attrs[0] not in (0, 1) or isinstance(attrs[0], bool) or x.width not in (Fraction(1), Fraction(2)):
            raise ProgramError(f"pair {attrs[0]!r} of {x.describe()}: expected half 0 or 1 of an N- or 2N-wide value")
        return x.dtype, x.width / 2
    if op == "interleave":
        _expect_attrs(node, 0)
        width = join_widths(list(args), f"interleave({x.describe()}, {args[1].describe()})")
        if width not in (Fraction(1, 2), Fraction(1)) or "bool" in (x.dtype, args[1].dtype):
            raise ProgramError(f"interleave({x.describe()}, {args[1].describe()}): expected two N/2- or N-wide numbers")
        return ("f32" if "f32" in (x.dtype, args[1].dtype) else "i32"), width * 2
    # segreduce
    _expect_attrs(node, 2)
    kind, segment = attrs
    if kind not in REDUCTIONS or isinstance(segment, bool) or not isinstance(segment, int) or segment <= 0:
        raise ProgramError(f"segment reduction {attrs!r}: expected (one of {REDUCTIONS}, a positive segment width)")
    if x.width is None or x.dtype == "bool":
        raise ProgramError(f"row_{kind}({x.describe()}, segment={segment}): needs a column-varying number")
    return "f32", x.width


def _expect_attrs(node: Node, count: int) -> None:
    if len(node.attrs) != count:
        raise ProgramError(f"node {node.op!r} takes {count} attribute(s), got {node.attrs!r}")


def _encode(value: object) -> object:
    if isinstance(value, float):
        return {"f": value.hex()}
    if isinstance(value, Fraction):
        return f"{value.numerator}/{value.denominator}"
    return value

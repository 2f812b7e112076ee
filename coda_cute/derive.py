"""Backward programs derived from forward programs (reverse-mode differentiation of the IR).

For a forward program ``y = f(acc, operands)`` with ``acc = x @ W.T``, training needs
``d_acc = J_f^T dy`` (then two GEMMs: ``dx = d_acc @ W``, ``dW = d_acc.T @ x``) and the
gradients of the operands.  ``derive`` writes that as a *backward program*, an ordinary
program of the language, so it is validated, lowered, compiled, cached and printed like any
other.  Its accumulator is one of two GEMM outputs:

- ``accumulator="upstream"`` (the default when a tile output has a gradient): the gradient of
  one tile output of the forward, ``grad_of``, as the next layer's dgrad GEMM produces it.
  The backward runs in that GEMM's epilogue (CODA's SwiGLU backward).  Values of the forward
  are recomputed from its saved pre-activation (operand ``preact``: the forward's ``acc``,
  stored by ``Derivative.forward``, which adds that output) whenever the gradient needs them.
  The backward's column space is the upstream gradient's: a forward value ``w`` times N wide
  is ``w / w_grad_of`` times the backward's N wide.
- ``accumulator="recompute"``: the forward's own GEMM again (``x @ W.T``), for programs whose
  outputs are all reductions (cross-entropy) or to recompute instead of saving; upstream
  gradients of tile outputs come in as tile operands.

With ``"upstream"`` and ``rebuild_output=True``, where the backward reads the saved
pre-activation anyway, it also rebuilds the output ``grad_of`` itself (``Derivative.recomputed``,
output ``<grad_of>_recomputed``): in a chain the next layer's weight gradient reads it there,
so it is not kept from the forward (the hand-written SwiGLU backward's ``h``).

Saving vs recomputing, stated once: a gradient that needs values of the forward recomputes them
from ``acc`` inside the backward epilogue; with ``"upstream"`` that costs one saved tile (the
pre-activation, in the inputs' dtype unless ``save_dtype`` says otherwise), with ``"recompute"``
one more GEMM.  Values the gradient does not need are never saved or recomputed.

What each output of the backward program holds (``Derivative.gradients`` says it per input):

- ``d_acc``: the gradient of the forward's accumulator (tile, inputs' dtype);
- ``d_<tile operand>``: a tile; ``d_<row vector>`` and ``d_<scalar>``: row sums of the
  backward (a scalar's gradient is their total); ``d_<column vector>``: column sums (a
  vector 2N wide in the backward's space comes back as two N-wide halves, even and odd
  columns; one N/2 wide as the even columns of an N-wide sum).

Upstream gradients are operands named ``d_<output>``: a tile for each tile output other than
the accumulator's, a per-row vector for a row reduction, a per-column vector for a column
reduction.  A log-sum-exp reduction also reads the forward's result (operand named like the
output).  Conventions, those of torch: a cast passes the gradient through unchanged
(straight-through; the values it is applied to are the stored, rounded ones); comparisons,
coordinates and integer values have no gradient; at ties, ``minimum``/``maximum`` split the
gradient in halves and a max over a segment splits it evenly among the maximal elements.  Max
and max-abs reductions over whole rows or columns (outputs) are statistics here: their gradient
would need the count of maximal elements across tiles, so they get none by default and asking
for one is refused.

Table operands (``T[row % R, col % P]``) cannot be differentiated: their gradient is a
scatter-add over rows and columns, which no epilogue value can express.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from fractions import Fraction

from . import frontend as language
from . import program as ir
from .errors import ProgramError
from .frontend import Expr
from .frontend import exp as _exp
from .frontend import interleave as _interleave
from .frontend import where as _where
from .primitives import ELEMENTWISE, NO_GRADIENT
from .program import Node, Operand, Output, Program

#: ways the backward's accumulator is formed (see the module docstring)
ACCUMULATORS = ("upstream", "recompute")
#: name of the operand holding the forward's saved accumulator
PREACT = "preact"

# --------------------------------------------------------------------------- reductions
def _reduction_gradient(kind: str, x, result, g, segment: int | None = None):
    """Gradient reaching x from ``result = reduce(kind, x)`` whose gradient, broadcast back over
    what was reduced, is g.  Max-like reductions split g evenly among the maximal elements (as
    torch does), which needs their count: only known inside a tile, for a segment reduction."""
    if kind == "sum":
        return g
    if kind == "sumsq":
        return 2.0 * x * g
    if kind == "logsumexp":
        return _exp(x - result) * g
    top = (x == result) if kind == "max" else (abs(x) == result)
    count = Expr(Node("segreduce", (_where(top, 1.0, 0.0).node,), ("sum", segment), "f32", x.node.width))
    share = g / count
    return _where(top, share if kind == "max" else _where(x < 0.0, -share, share), 0.0)


# --------------------------------------------------------------------------- the result
@dataclass(frozen=True)
class Gradient:
    """How one forward input's gradient is read off the backward's outputs.

    ``outputs``: the backward outputs to add up (a value read in several column spaces has one
    per space); ``layout``: 'tile', 'row' (per-row sums), 'scalar' (per-row sums: total them),
    'col' (column sums), 'col_pairs' (outputs alternate even-column and odd-column halves:
    interleave each pair) or 'col_even' (the vector is the even columns of each output)."""

    name: str
    outputs: tuple[str, ...]
    layout: str


@dataclass(frozen=True)
class Derivative:
    """A forward program, the program to run in its place in training, and its backward."""

    program: Program
    forward: Program  # ``program``, plus output ``preact`` where the backward reads it
    backward: Program
    accumulator: str
    grad_of: str | None  # the tile output whose gradient is the backward's accumulator
    wrt: tuple[str, ...]  # the inputs differentiated ("acc" and operand names)
    gradients: tuple[Gradient, ...]  # one per differentiated input with a nonzero gradient
    upstream: tuple[str, ...]  # forward outputs whose gradient the backward takes
    upstream_operands: tuple[tuple[str, str], ...]  # (output, the backward operand holding its gradient)
    saved_outputs: tuple[str, ...]  # forward outputs the backward reads as operands
    recomputed: str | None = None  # the backward output that holds ``grad_of`` rebuilt (module docstring)

    def assemble(self, results: dict) -> dict:
        """The gradient of each differentiated input (``"acc"`` and operand names) from the
        backward's finished outputs (``results``: output name -> tensor): one output as it is
        (no copy: a tile gradient stays in the dtype the kernel stored), several added in fp32."""
        grads = {}
        for grad in self.gradients:
            parts = [results[name] for name in grad.outputs]
            if grad.layout == "col_pairs":  # (even columns, odd columns), (even, odd), ...
                parts = [_interleave_columns(even, odd) for even, odd in zip(parts[::2], parts[1::2])]
            elif grad.layout == "col_even":
                parts = [part[..., ::2] for part in parts]
            total = parts[0]  # one part keeps its dtype: a tile gradient stays as the kernel stored it
            if len(parts) > 1:  # several add up in fp32
                total = parts[0].float()
                for part in parts[1:]:
                    total = total + part.float()
            grads[grad.name] = total.float().sum() if grad.layout == "scalar" else total
        return grads

    def describe(self) -> str:
        lines = [f"derivative of {self.program.name}: accumulator = "
                 + (f"d {self.grad_of} (upstream)" if self.accumulator == "upstream" else "x @ W.T again (recompute)")]
        for grad in self.gradients:
            lines.append(f"  d {grad.name}: {' + '.join(grad.outputs)} ({grad.layout})")
        return "\n".join(lines)


# --------------------------------------------------------------------------- derivation
def derive(program: Program, *, wrt: Iterable[str] | None = None, outputs: Iterable[str] | None = None,
           accumulator: str | None = None, grad_of: str | None = None, save_dtype: str = "in",
           name: str | None = None, rebuild_output: bool = False) -> Derivative:
    """The backward program of ``program`` (see the module docstring).

    ``wrt``: the inputs to differentiate: ``"acc"`` and operand names (default: ``acc`` and every
    operand but tables and index vectors); ``outputs``: the forward outputs whose gradient flows
    back (default: all); ``accumulator``: ``"upstream"`` (default where ``outputs`` has a tile)
    or ``"recompute"``; ``grad_of``: with ``"upstream"``, the tile output whose gradient is the
    accumulator (default: the first tile output in ``outputs``); ``save_dtype``: the saved
    pre-activation's storage dtype; ``rebuild_output``: with ``"upstream"``, also rebuild
    ``grad_of`` where the backward reads the pre-activation anyway (``Derivative.recomputed``).
    Raises ProgramError naming what cannot be derived."""
    if program.a_transform is not None:
        raise ProgramError(f"program {program.name!r} transforms A ({program.a_transform}); derivation covers "
                           "epilogues of a plain product only")
    plain = (wrt, outputs, accumulator, grad_of, save_dtype, name, rebuild_output) == \
        (None, None, None, None, "in", None, False)
    deriver = _Deriver(program, wrt, outputs, accumulator, grad_of, save_dtype, name, plain)
    if rebuild_output is not False and (rebuild_output is not True or deriver.accumulator != "upstream"):
        raise ProgramError(f"derive({program.name}): rebuild_output=True is for accumulator='upstream', "
                           f"got {rebuild_output!r} with {deriver.accumulator!r}")
    deriver.rebuild_output = rebuild_output
    return deriver.run()


class _Deriver:
    def __init__(self, program, wrt, outputs, accumulator, grad_of, save_dtype, name, plain):
        self.plain = plain  # derive(program) with every default: what `coda-cute emit --backward` runs
        if not isinstance(program, Program):
            raise ProgramError(f"derive() takes a Program, got {type(program).__name__}")
        self.p = program
        self.name = ir.check_name(name or f"{program.name}_backward", "program")
        out_names = [o.name for o in program.outputs]
        self.outputs = self._upstream_outputs(outputs)
        if not self.outputs:
            raise ProgramError(f"derive({program.name}): no output gradient flows back (outputs=[])")
        tile_outputs = [n for n in self.outputs if not self._output(n).is_reduction]
        if accumulator is None:
            accumulator = "upstream" if tile_outputs else "recompute"
        if accumulator not in ACCUMULATORS:
            raise ProgramError(f"derive({program.name}): accumulator {accumulator!r} is not one of {ACCUMULATORS}")
        self.accumulator = accumulator
        if accumulator == "upstream":
            if grad_of is None:
                if not tile_outputs:
                    raise ProgramError(f"derive({program.name}): accumulator='upstream' takes the gradient of a "
                                       "tile output, and no output with a gradient is a tile; use 'recompute'")
                grad_of = tile_outputs[0]
            if grad_of not in tile_outputs:
                raise ProgramError(f"derive({program.name}): grad_of={grad_of!r} must be a tile output whose "
                                   f"gradient flows back: {tile_outputs}")
            self.scale = self._output(grad_of).node.width  # the backward's N, in forward widths
        elif grad_of is not None:
            raise ProgramError(f"derive({program.name}): grad_of is for accumulator='upstream'")
        else:
            self.scale = Fraction(1)
        self.grad_of = grad_of
        if save_dtype not in ir.STORAGE_DTYPES:
            raise ProgramError(f"derive({program.name}): save_dtype {save_dtype!r} is not one of {ir.STORAGE_DTYPES}")
        self.save_dtype = save_dtype
        self.wrt = self._targets(wrt)
        self.operands: dict[str, Operand] = {}  # the backward's, by name, as first read
        self.primal: dict[int, Expr] = {}  # forward node -> its value in the backward
        self.used_names = {o.name for o in program.operands} | set(out_names)
        self.saved = stored_accumulator(program, save_dtype)  # a forward output that is acc already
        self.preact = self.saved or self.fresh(PREACT)

    # -- checks and names
    def _output(self, name: str) -> Output:
        return next(o for o in self.p.outputs if o.name == name)

    def _targets(self, wrt) -> tuple[str, ...]:
        p = self.p
        index = ir.index_operands(p)
        names = ["acc"] + [o.name for o in p.operands]
        if wrt is None:
            return tuple(["acc"] + [o.name for o in p.operands if o.kind != "table" and o.name not in index])
        chosen = _names(wrt, names, "input", p.name)
        for name in chosen:
            if name != "acc" and p.operand(name).kind == "table":
                raise ProgramError(f"derive({p.name}): table operand {name!r} cannot be differentiated: its "
                                   "gradient is a scatter-add over T[row % R, col % P], which no epilogue value "
                                   "expresses")
        return tuple(chosen)

    def width(self, width: Fraction | None, what: str) -> Fraction | None:
        """A forward width in the backward's column space."""
        if width is None:
            return None
        scaled = width / self.scale
        if scaled not in ir.WIDTHS:
            raise ProgramError(
                f"derive({self.p.name}): {what} is {ir.width_str(width)} wide, {ir.width_str(scaled)} in the "
                f"backward's columns (those of d {self.grad_of}, {ir.width_str(self.scale)} wide); values are "
                "N/2, N or 2N wide there. Take the gradient of a wider output (grad_of=) or accumulator='recompute'")
        return scaled

    def fresh(self, base: str) -> str:
        name, k = base, 2
        while name in self.used_names:
            name, k = f"{base}_{k}", k + 1
        self.used_names.add(name)
        return name

    def operand(self, name: str, kind: str, width: Fraction | None) -> Expr:
        known = self.operands.get(name)
        if known is None:
            self.operands[name] = Operand(name, kind, width)
        return Expr(Node("load", (), (name,), "f32", width))

    # -- the forward's values, recomputed in the backward
    def value(self, node: Node) -> Expr:
        key = id(node)
        if key in self.primal:
            return self.primal[key]
        op = node.op
        if op == "acc":
            if self.accumulator == "recompute":
                built = Node("acc", (), (), "f32", Fraction(1))
            else:
                built = self.operand(self.preact, "tile", self.width(Fraction(1), "the accumulator")).node
        elif op == "load":
            fwd = self.p.operand(node.attrs[0])
            built = self.operand(fwd.name, fwd.kind, self.width(fwd.width, f"operand {fwd.name!r}")).node
        elif op in ("const", "row"):
            built = node
        elif op == "col":
            built = Node("col", (), (), "i32", self.width(node.width, "a column index"))
        else:
            args = tuple(self.value(a).node for a in node.args)
            width = self.width(node.width, f"value {node.describe()}")
            built = Node(op, args, node.attrs, node.dtype, width, node.hint)
        self.primal[key] = Expr(built)
        return self.primal[key]

    def _upstream_outputs(self, outputs) -> list[str]:
        """The outputs whose gradient flows back: those asked for (default: all but max-like
        reductions, which are statistics here: see ``_reduction_gradient``)."""
        p = self.p
        if outputs is None:
            return [o.name for o in p.outputs if o.reduce not in ("max", "maxabs")]
        chosen = _names(outputs, [o.name for o in p.outputs], "output", p.name)
        for name in chosen:
            out = self._output(name)
            if out.reduce in ("max", "maxabs"):
                raise ProgramError(
                    f"derive({p.name}): output {name!r} is a {out.axis} {out.reduce} over the whole "
                    f"{out.axis}; its gradient goes to the maximal elements, split by how many there are, "
                    "which one epilogue pass cannot count across tiles. Leave it out of outputs= (a "
                    "segment reduction, row_max(x, segment=S), can be differentiated)")
        return chosen

    # -- reverse sweep
    def run(self) -> Derivative:
        p = self.p
        # forward node -> {column space: gradient}.  A gradient is keyed by the column space it is
        # spread over: the node's own, or for a value that is the same along a row, the space of
        # the consumer it reached the value through (its own value may be row-constant too, e.g. an
        # upstream per-row gradient); the row sums at the end add it up over that space.
        grads: dict[int, dict] = {}
        halves: dict[int, list] = {}  # forward node -> [gradient of its even half, of its odd half]

        def add(node: Node, g: Expr | None, space: Fraction) -> None:
            if g is None or node.dtype != "f32":
                return
            slot = grads.setdefault(id(node), {})
            slot[space] = g if space not in slot else slot[space] + g

        saved_outputs = []
        upstream = []
        upstream_operands = []
        for out in (self._output(n) for n in self.outputs):
            upstream.append(out.name)
            if out.is_reduction:
                x = self.value(out.node)
                kind = "row" if out.axis == "row" else "col"
                width = None if kind == "row" else self.width(out.node.width, f"output {out.name!r}")
                g = self.operand(self.fresh(f"d_{out.name}"), kind, width)
                upstream_operands.append((out.name, g.node.attrs[0]))
                result = None
                if out.reduce == "logsumexp":
                    result = self.operand(out.name, kind, width)
                    saved_outputs.append(out.name)
                add(out.node, _reduction_gradient(out.reduce, x, result, g), self.width(out.node.width, out.name))
            elif out.name == self.grad_of:
                add(out.node, Expr(Node("acc", (), (), "f32", Fraction(1))), Fraction(1))
            else:
                width = self.width(out.node.width, f"output {out.name!r}")
                g = self.operand(self.fresh(f"d_{out.name}"), "tile", width)
                upstream_operands.append((out.name, g.node.attrs[0]))
                add(out.node, g, width)

        for node in reversed(p.nodes):
            if id(node) in halves:
                even, odd = halves.pop(id(node))
                add(node, _interleave(0.0 if even is None else even, 0.0 if odd is None else odd),
                    self.width(node.width, node.describe()))
            slot = grads.get(id(node))
            if not slot or node.op in ("acc", "load"):
                continue
            for space, g in list(slot.items()):
                self._propagate(node, g, space, add, halves)

        outputs, gradients = self._outputs(grads)
        if not outputs:
            raise ProgramError(f"derive({p.name}): no input in {list(self.wrt)} receives a gradient from "
                               f"outputs {self.outputs}")
        declared = _reads(outputs)
        recomputed = None
        if self.rebuild_output and self.preact in declared:
            out = self._output(self.grad_of)
            recomputed = self.fresh(f"{out.name}_recomputed")
            outputs.append(Output(recomputed, self.value(out.node).node, out.dtype))
            declared = _reads(outputs)
        operands = [op for name, op in self.operands.items() if name in declared]
        doc = (f"Backward of {p.name} (derived): accumulator = "
               + (f"the gradient of {self.grad_of}." if self.accumulator == "upstream" else "the forward's GEMM again."))
        backward = Program(self.name, operands, outputs, doc=doc, derived_from=p if self.plain else None)
        forward = p
        if self.preact in declared and self.saved:
            saved_outputs.append(self.saved)
        elif self.preact in declared:
            stored = Output(self.preact, _cast(_acc_node(p), self.save_dtype), self.save_dtype)
            forward = Program(p.name + "_save", list(p.operands), list(p.outputs) + [stored], doc=p.doc)
        return Derivative(p, forward, backward, self.accumulator, self.grad_of, self.wrt, tuple(gradients),
                          tuple(upstream), tuple((o, n) for o, n in upstream_operands if n in declared),
                          tuple(saved_outputs), recomputed)

    def _propagate(self, node: Node, g: Expr, space: Fraction, add, halves) -> None:
        """Pass g, the gradient of ``node`` spread over ``space``, on to its arguments."""
        op = node.op

        def give(arg: Node, grad: Expr | None) -> None:
            add(arg, grad, space if arg.width is None else self.width(arg.width, arg.describe()))

        if op in ("const", "row", "col"):
            return
        if op == "cast":
            give(node.args[0], g)
            return
        if op == "pair":
            slot = halves.setdefault(id(node.args[0]), [None, None])
            k = node.attrs[0]
            g = _broadcast(g, space)
            slot[k] = g if slot[k] is None else slot[k] + g
            return
        if op == "interleave":
            even, odd = language.pairs(_broadcast(g, space))
            give(node.args[0], even)
            give(node.args[1], odd)
            return
        if op == "segreduce":
            kind, segment = node.attrs
            g = _broadcast(g, space)
            segment_sum = Expr(Node("segreduce", (g.node,), ("sum", segment), "f32", g.node.width))
            give(node.args[0], _reduction_gradient(kind, self.value(node.args[0]), self.value(node), segment_sum,
                                                   segment))
            return
        entry = ELEMENTWISE[op]  # the op's definition in primitives.py, its derivative rule with it
        if entry.typing in NO_GRADIENT:
            return
        if entry.derivative is None:
            raise ProgramError(f"derive({self.p.name}): op {op!r} has no derivative rule ({node.describe()})")
        rule = entry.derivative
        args = tuple(self.value(a) for a in node.args)
        for arg, grad in zip(node.args, rule(g, args, self.value(node), language)):
            give(arg, grad)

    def _outputs(self, grads) -> tuple[list[Output], list[Gradient]]:
        outputs: list[Output] = []
        gradients: list[Gradient] = []
        stored: dict[int, str] = {}  # one tile output per value (d_acc and d_residual of h = acc + residual)
        leaves = {}
        for node in self.p.nodes:
            if node.op == "acc":
                leaves.setdefault("acc", []).append(node)
            elif node.op == "load":
                leaves.setdefault(node.attrs[0], []).append(node)
        for name in self.wrt:
            slot: dict = {}
            for node in leaves.get(name, []):
                for width, g in grads.get(id(node), {}).items():
                    slot[width] = g if width not in slot else slot[width] + g
            if not slot:
                continue
            kind = "acc" if name == "acc" else self.p.operand(name).kind
            base = "d_acc" if name == "acc" else f"d_{name}"
            names = []
            layout = kind
            for width, g in slot.items():
                g = _broadcast(g, width)
                if kind in ("acc", "tile"):
                    if id(g.node) not in stored:
                        stored[id(g.node)] = self.fresh(base)
                        outputs.append(Output(stored[id(g.node)], _cast(g.node, "in"), "in"))
                    names.append(stored[id(g.node)])
                    layout = "tile"
                elif kind in ("row", "scalar"):
                    names.append(self.fresh(base))
                    outputs.append(Output(names[-1], g.node, None, "sum", "row"))
                else:  # a column vector: column sums over N-wide values
                    if width == Fraction(1):
                        parts, layout = [g], "col"
                    elif width == Fraction(2):
                        parts, layout = list(language.pairs(g)), "col_pairs"
                    else:
                        parts, layout = [_interleave(g, 0.0)], "col_even"
                    for part in parts:
                        names.append(self.fresh(base))
                        outputs.append(Output(names[-1], part.node, None, "sum", "col"))
            gradients.append(Gradient(name, tuple(names), layout))
        return outputs, gradients


# --------------------------------------------------------------------------- helpers
def _names(given, allowed: list[str], what: str, program: str) -> list[str]:
    if isinstance(given, str):
        given = [given]
    chosen = list(dict.fromkeys(given))
    for name in chosen:
        if name not in allowed:
            raise ProgramError(f"derive({program}): {what} {name!r} is not one of {allowed}")
    return chosen


def stored_accumulator(program: Program, dtype: str) -> str | None:
    """The name of a tile output of ``program`` that stores acc itself in ``dtype``, if one does."""
    for out in program.tile_outputs:
        node, stored = out.node, out.dtype or "in"
        if node.op == "cast":
            node = node.args[0]
        if node.op == "acc" and stored == dtype:
            return out.name
    return None


def _acc_node(program: Program) -> Node:
    for node in program.nodes:
        if node.op == "acc":
            return node
    return Node("acc", (), (), "f32", Fraction(1))


def _cast(node: Node, dtype: str) -> Node:
    return Node("cast", (node,), (dtype,), "f32", node.width)


def _interleave_columns(even, odd):
    """Vectors of the even and the odd columns as one vector of all columns."""
    joined = even.new_empty(even.shape[:-1] + (2 * even.shape[-1],))
    joined[..., 0::2], joined[..., 1::2] = even, odd
    return joined


def _broadcast(g: Expr, space: Fraction) -> Expr:
    """g, which may be the same along a row (an upstream per-row gradient), as a value of column
    space ``space``: selected at every column, so that pairs and sums see ``space``'s columns."""
    if g.node.width is not None:
        return g
    col = Expr(Node("col", (), (), "i32", space))
    return _where(col >= 0, g, 0.0)


def _reads(outputs: list[Output]) -> set[str]:
    names = set()
    for node in ir._walk([o.node for o in outputs]):
        if node.op == "load":
            names.add(node.attrs[0])
    return names

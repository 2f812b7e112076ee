"""Programs as PyTorch operators: ``torch.ops.coda_cute.<program>_<fingerprint>`` with fake implementations.

    op = coda_cute.ops.library_op(program)        # registers coda_cute::<name> once
    d, sumsq = op(a, b, residual)                  # operands in program order, then outputs

Each op takes A, B and the program's operands in declaration order (tensors, or floats for
scalars) and returns the outputs in declaration order (tile outputs in their dtype,
reductions finished in fp32).  The fake (meta) implementation gives shapes and dtypes
without running anything, so ``torch.compile(fullgraph=True)`` traces through calls.
On CPU tensors an op runs the reference interpreter with the kernel's layout rules relaxed
(``Kernel(program, strict=False)``), so modules built on these ops train in fp32 on a CPU.

    f = coda_cute.ops.trainable(program)          # any forward program: a differentiable op
    y = f(x, w, bias)                              # y = program(x @ w.T, bias); y.sum().backward()

``trainable`` derives the program's backward (``derive.py``) and runs it as one fused kernel,
the forward's GEMM again with the gradient in its epilogue, before the two GEMMs of x and w.
"""

from __future__ import annotations

import inspect
import threading

import torch

from .derive import Derivative, derive
from .errors import ArgumentError, ProgramError
from .program import Program, index_operands
from .runtime import Kernel

_OPS: dict[str, object] = {}
_LOCK = threading.Lock()


def op_name(program: Program) -> str:
    """The op's name: the program's, plus its fingerprint so variants (with_constants) coexist."""
    return f"{program.name}_{program.fingerprint[:10]}"


def library_op(program: Program, overwrite: dict[str, str] | None = None):
    """The registered custom op for ``program`` (one per fingerprint, stable across processes).

    ``overwrite={output: operand}`` makes an op that writes that tile output over the operand's
    tensor, in place, and returns the other outputs: e.g. the SwiGLU backward writes the gradient
    of the pre-activation over the saved pre-activation (same shape and dtype), so the two never
    occupy memory at once.  Each tile of the operand is read before the tile over it is written."""
    overwrite = dict(overwrite or {})
    name = op_name(program) + "".join(f"_{out}_over_{operand}" for out, operand in sorted(overwrite.items()))
    with _LOCK:
        if name not in _OPS:
            _OPS[name] = _register(program, name, overwrite)
        return _OPS[name]


def _register(program: Program, name: str, overwrite: dict):
    kernel = Kernel(program, strict=False)  # on CPU tensors, any layout the reference can run (fp32 modules)
    names = [op.name for op in program.operands]
    tiles = {o.name for o in program.tile_outputs}
    if not set(overwrite) <= tiles or not set(overwrite.values()) <= set(names):
        raise ProgramError(f"{program.name}: overwrite={overwrite} must map tile outputs {sorted(tiles)} to "
                           f"operands {names}")
    outputs = [o for o in program.outputs if o.name not in overwrite]  # none: the op returns None

    def impl(a, b, *operands):
        given = dict(zip(names, operands))
        result = kernel(a, b, out={out: given[operand] for out, operand in overwrite.items()} or None, **given)
        if not isinstance(result, dict):
            result = {program.outputs[0].name: result}
        if not outputs:
            return None
        if len(outputs) == 1:
            single = result[outputs[0].name]
            return single.clone() if _aliases(single, a, b, operands) else single
        return tuple(result[o.name] for o in outputs)

    def fake(a, b, *operands):
        batch, n = tuple(a.shape[:-1]), b.shape[0]
        made = []
        for o in outputs:
            cols = n * o.node.width.numerator // o.node.width.denominator  # n may be symbolic
            if o.is_reduction:
                made.append(a.new_empty(batch if o.axis == "row" else (cols,), dtype=torch.float32))
            else:
                dtype = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}.get(o.dtype, a.dtype)
                made.append(a.new_empty((*batch, cols), dtype=dtype))
        return None if not made else made[0] if len(made) == 1 else tuple(made)

    # "__" cannot be in a program's names, so A and B never collide with an operand's
    params = [inspect.Parameter("a__", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=torch.Tensor),
              inspect.Parameter("b__", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=torch.Tensor)]
    params += [inspect.Parameter(op.name, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                 annotation=float if op.kind == "scalar" else torch.Tensor) for op in program.operands]
    returns = (None if not outputs else torch.Tensor if len(outputs) == 1
               else tuple.__class_getitem__((torch.Tensor,) * len(outputs)))
    signature = inspect.Signature(params, return_annotation=returns)
    for function in (impl, fake):
        function.__signature__ = signature
        function.__annotations__ = {p.name: p.annotation for p in params} | {"return": returns}
    op = torch.library.custom_op(f"coda_cute::{name}", impl, mutates_args=tuple(sorted(set(overwrite.values()))))
    op.register_fake(fake)
    op.program = program
    op.kernel = kernel
    return op


def _aliases(result, a, b, operands) -> bool:
    """A custom op may not return one of its inputs (the reference path can, e.g. for `gemm` of views)."""
    ptr = result.data_ptr()
    return any(isinstance(t, torch.Tensor) and t.data_ptr() == ptr for t in (a, b, *operands))


def trainable(program: Program, *, wrt=None, outputs=None):
    """``program`` as a differentiable operator ``f(x, w, *operands)``: the outputs of
    ``program(x @ w.T, operands)`` as ``library_op`` returns them, with gradients for x, w and
    the tensor operands (``wrt``: operand names to differentiate, default all but tables and index
    vectors; ``outputs``: the outputs whose gradient flows back, default all but max reductions,
    see ``derive``).  Scalars are floats and get no gradient.

    Forward: the program's own kernel, saving nothing but its inputs.  Backward: the derived
    program (``derive(program, accumulator="recompute")``) runs the forward's GEMM again with the
    gradient of the accumulator and the operands' gradients in its epilogue, then
    ``dx = d_acc @ w`` and ``dw = d_acc.T @ x`` (cuBLAS).  Both are ``library_op`` custom ops, so
    ``torch.compile(fullgraph=True)`` traces the step."""
    if not isinstance(program, Program):
        raise ProgramError(f"trainable() takes a Program, got {type(program).__name__}")
    scalars = [op.name for op in program.operands if op.kind == "scalar"]
    if wrt is None:
        index = set(index_operands(program))
        wrt = ["acc"] + [op.name for op in program.operands
                         if op.kind in ("row", "col", "tile") and op.name not in index]
    else:
        wrt = ["acc"] + [name for name in ([wrt] if isinstance(wrt, str) else list(wrt)) if name != "acc"]
        for name in wrt:
            if name in scalars:
                raise ProgramError(f"trainable({program.name}): scalar {name!r} is a float at call time and has no "
                                   "gradient; make it a RowVec or ColVec to learn it")
    derivative = derive(program, wrt=wrt, outputs=outputs, accumulator="recompute")
    return _Trainable(derivative)


class _Trainable:
    """The operator ``trainable`` returns (a callable; ``.derivative`` shows what it runs)."""

    def __init__(self, derivative: Derivative):
        self.derivative = derivative
        self.program = derivative.program
        self.forward_op = library_op(derivative.program)
        self.backward_op = library_op(derivative.backward)
        self.names = [op.name for op in self.program.operands]

    def __call__(self, x: torch.Tensor, w: torch.Tensor, *operands, **named):
        given = dict(zip(self.names, operands))
        if len(operands) > len(self.names) or set(given) & set(named) or set(named) - set(self.names):
            raise ArgumentError(f"{self.program.name}: expected operands {self.names} (positional or by name), got "
                                f"{len(operands)} positional and {sorted(named)}")
        given.update(named)
        missing = [name for name in self.names if name not in given]
        if missing:
            raise ArgumentError(f"{self.program.name}: missing operand(s) {missing}")
        outputs = _TrainableFunction.apply(self, x, w, *(given[name] for name in self.names))
        return outputs[0] if len(outputs) == 1 else outputs

    def __repr__(self) -> str:
        return f"<coda_cute trainable op {self.program.name}: {self.derivative.backward.name}>"


class _TrainableFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op: _Trainable, x, w, *operands):
        result = op.forward_op(x, w, *operands)
        ctx.op = op
        ctx.tensors = [i for i, t in enumerate(operands) if isinstance(t, torch.Tensor)]
        ctx.scalars = {i: t for i, t in enumerate(operands) if not isinstance(t, torch.Tensor)}
        outputs = result if isinstance(result, tuple) else (result,)
        by_name = {o.name: t for o, t in zip(op.program.outputs, outputs)}
        saved = [by_name[name] for name in op.derivative.saved_outputs]  # e.g. a log-sum-exp the gradient reads
        ctx.save_for_backward(x, w, *saved, *(operands[i] for i in ctx.tensors))
        ctx.saved_count = len(saved)
        statistics = [t for o, t in zip(op.program.outputs, outputs) if o.name not in op.derivative.upstream]
        if statistics:
            ctx.mark_non_differentiable(*statistics)
        return outputs  # a tuple always (a single output is unwrapped by the caller)

    @staticmethod
    def backward(ctx, *grads):
        op: _Trainable = ctx.op
        d = op.derivative
        x, w, *tensors = ctx.saved_tensors
        saved, tensors = tensors[:ctx.saved_count], tensors[ctx.saved_count:]
        operands = dict(ctx.scalars)
        operands.update(zip(ctx.tensors, tensors))
        values = {name: operands[i] for i, name in enumerate(op.names)}
        values.update(zip(d.saved_outputs, saved))
        holders = dict(d.upstream_operands)  # output -> the backward operand of its gradient
        for out, grad in zip(op.program.outputs, grads):
            if out.name not in holders:
                continue
            cols = w.shape[0] * out.node.width.numerator // out.node.width.denominator
            if out.is_reduction:
                shape = x.shape[:-1] if out.axis == "row" else (cols,)
                grad = (grad if grad is not None else x.new_zeros(shape)).float()
            else:  # a tile gradient, read like a tile operand: in the inputs' dtype
                grad = (grad if grad is not None else x.new_zeros((*x.shape[:-1], cols))).to(x.dtype).contiguous()
            values[holders[out.name]] = grad
        args = [values[operand.name] for operand in d.backward.operands]
        result = op.backward_op(x, w, *args)
        result = result if isinstance(result, tuple) else (result,)
        grads_of = d.assemble({o.name: t for o, t in zip(d.backward.outputs, result)})
        d_acc = grads_of.get("acc")
        dx = dw = None
        if d_acc is not None:
            d_acc = d_acc.to(x.dtype)
            dx = (d_acc @ w) if ctx.needs_input_grad[1] else None
            if ctx.needs_input_grad[2]:
                dw = d_acc.reshape(-1, d_acc.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
        operand_grads = []
        for i, name in enumerate(op.names):
            value = values[name]
            grad = grads_of.get(name)
            if grad is None or not isinstance(value, torch.Tensor) or not ctx.needs_input_grad[3 + i]:
                operand_grads.append(None)
            else:
                operand_grads.append(grad.reshape(value.shape).to(value.dtype))
        return (None, dx, dw, *operand_grads)

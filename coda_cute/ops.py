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
import math
import threading

import torch

from .arguments import TORCH_DTYPES, short_dtype
from .config import KernelConfig
from .derive import Derivative, derive, stored_accumulator
from .errors import ArgumentError, ProgramError
from .program import Program, index_operands
from .reference import evaluate_accumulator
from .runtime import Kernel
from .signature import host_arguments

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
        """The outputs as the kernel's host function takes them (``signature``), leading batch dims kept."""
        batch, n = tuple(a.shape[:-1]), b.shape[0]
        dtype = short_dtype(a.dtype) if a.dtype in TORCH_DTYPES.values() else "f32"
        arguments = {arg.of: arg for arg in host_arguments(program, KernelConfig(dtype=dtype))
                     if arg.role in ("output", "result")}
        made = []
        for o in outputs:
            arg = arguments[o.name]
            shape = arg.shape(math.prod(batch), n, a.shape[-1], KernelConfig.tile)  # outputs need no tile
            shape = (*batch, *shape[1:]) if arg.dims[0] == "M" else shape
            made.append(a.new_empty(shape, dtype=TORCH_DTYPES[arg.dtype]))
        return None if not made else made[0] if len(made) == 1 else tuple(made)

    # "__" cannot be in a program's names, so A and B never collide with an operand's
    params = [inspect.Parameter("a__", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=torch.Tensor),
              inspect.Parameter("b__", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=torch.Tensor)]
    params += [inspect.Parameter(op.name, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                 annotation=torch.Tensor if op.is_tensor else float) for op in program.operands]
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
    if wrt is None:
        wrt = _default_wrt(program)
    else:
        wrt = ["acc"] + [name for name in ([wrt] if isinstance(wrt, str) else list(wrt)) if name != "acc"]
        scalars = [name for name in wrt[1:] if name in {op.name for op in program.operands if op.kind == "scalar"}]
        if scalars:
            raise ProgramError(f"trainable({program.name}): scalar {scalars[0]!r} is a float at call time and has "
                               "no gradient; make it a RowVec or ColVec to learn it")
    return _Trainable(_Chain([_last_layer(program, wrt, outputs)]))


class _Trainable:
    """The operator ``trainable`` returns: ``f(x, w, *operands, **operands_by_name)``."""

    def __init__(self, chain: "_Chain"):
        self.chain = chain
        self.derivative = chain.layers[0]
        self.program = self.derivative.program
        self.names = chain.names[0]

    def __call__(self, x: torch.Tensor, w: torch.Tensor, *operands, **named):
        given = dict(zip(self.names, operands))
        if len(operands) > len(self.names) or set(given) & set(named) or set(named) - set(self.names):
            raise ArgumentError(f"{self.program.name}: expected operands {self.names} (positional or by name), got "
                                f"{len(operands)} positional and {sorted(named)}")
        given.update(named)
        missing = [name for name in self.names if name not in given]
        if missing:
            raise ArgumentError(f"{self.program.name}: missing operand(s) {missing}")
        return self.chain(x, [w], [given])

    def __repr__(self) -> str:
        return f"<coda_cute trainable op {self.program.name}: {self.derivative.backward.name}>"


def trainable_chain(programs, *, outputs=None):
    """GEMM + epilogue layers in a row, ``y_i = program_i(y_{i-1} @ w_i.T, operands_i)``, as one
    differentiable operator ``f(x, weights, operands)`` (``operands``: one dict per layer, by
    name) returning the last layer's outputs.  Each layer but the last passes on its first tile
    output; its other outputs stay inside.

    This is CODA's backward: the gradient of layer i's output is the dgrad GEMM of layer i + 1
    (``d_acc_{i+1} @ w_{i+1}``), and layer i's derived backward (``derive(program_i,
    grad_of=<that output>)``) runs in that GEMM's epilogue, reading the pre-activation the
    forward saved.  The last layer's backward is an elementwise pass over the gradient where it
    needs no value of the forward (a residual add), else its GEMM again (as ``trainable``);
    ``outputs``: the last layer's outputs whose gradient flows back (default all but max
    reductions; leave out statistics, e.g. a sum of squares for the next norm, to spare their
    gradient's terms).  Weight gradients are plain GEMMs (cuBLAS)."""
    programs = list(programs)
    if not programs or not all(isinstance(p, Program) for p in programs):
        raise ProgramError("trainable_chain() takes a non-empty list of Programs")
    layers = []
    for i, program in enumerate(programs[:-1]):
        if not program.tile_outputs:
            raise ProgramError(f"trainable_chain: layer {i} ({program.name}) has no tile output to pass on")
        passed = program.tile_outputs[0].name
        layers.append(derive(program, outputs=[passed], grad_of=passed, accumulator="upstream",
                             wrt=_default_wrt(program), rebuild_output=True))
    layers.append(_last_layer(programs[-1], _default_wrt(programs[-1]), outputs))
    return _Chain(layers)


def _last_layer(program: Program, wrt, outputs) -> Derivative:
    """The derivative of a chain's last layer, whose output gradients come from autograd: with the
    gradient of a tile output as accumulator where the backward reads nothing the forward
    computed (then it is an elementwise pass over that gradient, ``reference.evaluate_accumulator``),
    else with the layer's GEMM again, the gradients as operands."""
    tiles = [o.name for o in program.tile_outputs if outputs is None or o.name in outputs]
    if tiles:
        try:
            d = derive(program, wrt=wrt, outputs=outputs, accumulator="upstream", grad_of=tiles[0])
        except ProgramError:  # e.g. a value too wide in that gradient's columns: recompute below
            d = None
        if d is not None and d.forward is d.program and not d.saved_outputs:
            return d
    return derive(program, wrt=wrt, outputs=outputs, accumulator="recompute")


def _default_wrt(program: Program) -> list[str]:
    index = set(index_operands(program))
    return ["acc"] + [op.name for op in program.operands if op.kind in ("row", "col", "tile") and op.name not in index]


class _Chain:
    def __init__(self, layers: list[Derivative]):
        self.layers = layers
        self.forward_ops = [library_op(d.forward) for d in layers]
        # each backward writes the accumulator's gradient over the saved accumulator where it reads
        # one it alone holds (_overwrite): one tokens x N buffer through the backward, not two
        self.overwrites = [_overwrite(d, last=i == len(layers) - 1) for i, d in enumerate(layers)]
        # the last layer's backward as a kernel, unless it is an elementwise pass (_last_layer)
        self.backward_ops = [library_op(d.backward, overwrite=o) for d, o in zip(layers[:-1], self.overwrites)]
        self.backward_ops.append(None if layers[-1].accumulator == "upstream"
                                 else library_op(layers[-1].backward, overwrite=self.overwrites[-1]))
        self.names = [[op.name for op in d.program.operands] for d in layers]

    def __call__(self, x: torch.Tensor, weights, operands=None):
        weights = list(weights)
        operands = [dict(o) for o in operands] if operands is not None else [{} for _ in self.layers]
        if len(weights) != len(self.layers) or len(operands) != len(self.layers):
            raise ArgumentError(f"trainable_chain of {len(self.layers)} layers: got {len(weights)} weights and "
                                f"{len(operands)} operand dicts")
        flat = []
        for i, (names, given) in enumerate(zip(self.names, operands)):
            if set(given) != set(names):
                raise ArgumentError(f"layer {i} ({self.layers[i].program.name}) takes operands {names}, got "
                                    f"{sorted(given)}")
            flat += [given[name] for name in names]
        outputs = _ChainFunction.apply(self, x, *weights, *flat)
        return outputs[0] if len(outputs) == 1 else outputs

    def __repr__(self) -> str:
        return f"<coda_cute trainable chain {' -> '.join(d.program.name for d in self.layers)}>"


class _ChainFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, chain: _Chain, x, *rest):
        n = len(chain.layers)
        weights, flat = rest[:n], rest[n:]
        per_layer, start = [], 0
        for names in chain.names:
            per_layer.append(list(flat[start:start + len(names)]))
            start += len(names)
        inputs, kept = [], []  # each layer's GEMM input; what each layer's backward reads of its forward
        y = x
        for i, (d, op) in enumerate(zip(chain.layers, chain.forward_ops)):
            inputs.append(y)
            result = op(y, weights[i], *per_layer[i])
            result = result if isinstance(result, tuple) else (result,)
            by_name = {o.name: t for o, t in zip(d.forward.outputs, result)}
            kept.append([by_name[name] for name in _kept(d)])
            if i < n - 1:
                y = by_name[d.grad_of]
        last = chain.layers[-1]
        outputs = tuple(by_name[o.name] for o in last.program.outputs)
        ctx.chain, ctx.counts = chain, [len(k) for k in kept]
        ctx.scalars = {j: t for j, t in enumerate(flat) if not isinstance(t, torch.Tensor)}
        ctx.tensor_slots = [j for j, t in enumerate(flat) if isinstance(t, torch.Tensor)]
        # a layer's input that the layer before rebuilds in its backward (Derivative.recomputed) is
        # not kept: only its shape, dtype and device, unless the last layer runs its GEMM again
        rebuilt = [False] + [d.recomputed is not None for d in chain.layers[:-1]]
        if chain.layers[-1].accumulator == "recompute":
            rebuilt[-1] = False
        ctx.input_meta = [(t.shape, t.dtype, t.device) if r else None for t, r in zip(inputs, rebuilt)]
        ctx.save_for_backward(*(None if r else t for t, r in zip(inputs, rebuilt)), *weights,
                              *(t for k in kept for t in k), *(flat[j] for j in ctx.tensor_slots))
        statistics = [t for o, t in zip(last.program.outputs, outputs) if o.name not in last.upstream]
        if statistics:
            ctx.mark_non_differentiable(*statistics)
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        chain: _Chain = ctx.chain
        n = len(chain.layers)
        saved = list(ctx.saved_tensors)
        inputs, weights, saved = saved[:n], saved[n:2 * n], saved[2 * n:]
        for j, meta in enumerate(ctx.input_meta):  # stand-ins until the layer before rebuilds them
            if meta is not None:
                shape, dtype, device = meta
                inputs[j] = torch.zeros((), dtype=dtype, device=device).expand(shape)
        kept = []
        for count in ctx.counts:
            kept.append(saved[:count])
            saved = saved[count:]
        flat = dict(ctx.scalars)
        flat.update(zip(ctx.tensor_slots, saved))
        per_layer, start = [], 0
        for names in chain.names:
            per_layer.append({name: flat[start + j] for j, name in enumerate(names)})
            start += len(names)

        operand_grads: list[dict] = [{} for _ in range(n)]
        weight_grads = [None] * n
        d_acc = None
        for i in reversed(range(n)):
            d = chain.layers[i]
            values = dict(per_layer[i])
            values.update(zip(_kept(d), kept[i]))
            if i == n - 1:  # the last layer: the gradients autograd gives, as operands
                _upstream_values(values, d, grads, inputs[i], weights[i])
            if i == n - 1 and d.accumulator == "upstream":  # an elementwise pass over the gradient
                given = {operand.name: values[operand.name] for operand in d.backward.operands}
                out, grad = next((o, g) for o, g in zip(d.program.outputs, grads) if o.name == d.grad_of)
                acc = _output_gradient(out, grad, inputs[i], weights[i])  # in the inputs' dtype
                if _hands_on(d.backward):  # e.g. a residual add's: the gradient itself, no pass
                    found = d.assemble({o.name: acc for o in d.backward.outputs})
                else:
                    found = d.assemble(one_pass(_interpreter_pass(d.backward), acc)(acc, given))
            else:
                if i == n - 1:  # its GEMM again
                    a, b = inputs[i], weights[i]
                else:  # in the dgrad of layer i + 1: acc = d_acc_{i+1} @ w_{i+1}, the gradient of y_i
                    a, b = d_acc, weights[i + 1].t()
                args = [values[operand.name] for operand in d.backward.operands]
                result = chain.backward_ops[i](a, b, *args)
                result = () if result is None else result if isinstance(result, tuple) else (result,)
                written = chain.overwrites[i]
                outputs = dict(zip((o.name for o in d.backward.outputs if o.name not in written), result))
                outputs.update({out: values[operand] for out, operand in written.items()})
                found = d.assemble(outputs)
                if d.recomputed is not None and ctx.input_meta[i + 1] is not None:
                    inputs[i + 1] = outputs[d.recomputed].reshape(ctx.input_meta[i + 1][0])
            if i < n - 1:
                weight_grads[i + 1] = _weight_gradient(d_acc, inputs[i + 1])
                # layer i + 1's input (rebuilt above, or kept from the forward) has no reader left:
                # released before the GEMMs below allocate (tokens x N_i at the step's peak)
                inputs[i + 1] = result = outputs = None
            d_acc = found.pop("acc", None)
            if d_acc is None:
                d_acc = inputs[i].new_zeros((*inputs[i].shape[:-1], weights[i].shape[0]))
            d_acc = d_acc.to(inputs[i].dtype)
            operand_grads[i] = found
        weight_grads[0] = _weight_gradient(d_acc, inputs[0])
        dx = d_acc @ weights[0] if ctx.needs_input_grad[1] else None
        flat_grads = []
        for i, names in enumerate(chain.names):
            for name in names:
                value, grad = per_layer[i][name], operand_grads[i].get(name)
                flat_grads.append(None if grad is None or not isinstance(value, torch.Tensor)
                                  else grad.reshape(value.shape).to(value.dtype))
        return (None, dx, *weight_grads, *flat_grads)


def _overwrite(d: Derivative, last: bool) -> dict[str, str]:
    """{the accumulator's gradient: the saved accumulator} where the backward reads the accumulator
    the forward stored, with the gradient's shape and dtype, and nobody else sees that tensor (a
    layer's own output the chain returns, e.g. a program's `preact`, is left alone)."""
    grad = next((g for g in d.gradients if g.name == "acc" and g.layout == "tile" and len(g.outputs) == 1), None)
    saved = stored_accumulator(d.forward, "in")
    if grad is None or saved is None or saved not in {op.name for op in d.backward.operands}:
        return {}
    if last and saved in {o.name for o in d.program.outputs}:
        return {}
    out = next(o for o in d.backward.tile_outputs if o.name == grad.outputs[0])
    operand = d.backward.operand(saved)
    if (out.dtype or "in") != "in" or operand.kind != "tile" or operand.width != out.node.width:
        return {}
    return {out.name: saved}


_COMPILED: dict = {}


def one_pass(function, t: torch.Tensor):
    """``function`` as torch.compile fuses it (elementwise passes and row reductions that plain
    torch runs as many kernels, Inductor as one to three: nn's `qkv_gradient`, `rms_statistics`,
    `cross_entropy_grad`, a chain's last-layer backward) when ``t`` is on the GPU; on the CPU,
    and under an outer torch.compile (which fuses it itself), the plain function."""
    if not t.is_cuda or torch.compiler.is_compiling():
        return function
    if function not in _COMPILED:
        _COMPILED[function] = torch.compile(function)
    return _COMPILED[function]


_PASSES: dict = {}


def _interpreter_pass(program: Program):
    """``f(acc, operands) -> outputs``: the reference interpreter over ``program`` given its
    accumulator, one function per program (made once) with a code object of its own: dynamo
    keeps its compiled graphs and counts recompiles per code object, so one shared function
    compiled (`one_pass`) would fall back to eager (or, with fullgraph, fail) after 8 programs."""
    if program.fingerprint not in _PASSES:
        def run(acc, operands):
            return evaluate_accumulator(program, acc, operands).outputs
        run.__code__ = run.__code__.replace()  # a fresh code object: a graph cache of its own
        _PASSES[program.fingerprint] = run
    return _PASSES[program.fingerprint]


def _hands_on(backward: Program) -> bool:
    """Whether every output of a backward program is its accumulator (the upstream gradient) in
    the input dtype, which that gradient already has: nothing to compute."""
    return not backward.operands and all(
        o.node.op == "cast" and o.node.attrs == ("in",) and o.node.args[0].op == "acc" for o in backward.outputs)


def _kept(d: Derivative) -> list[str]:
    """Forward outputs a layer's backward reads: the saved pre-activation and saved results."""
    operands = {op.name for op in d.backward.operands}
    extra = [o.name for o in d.forward.outputs if o.name not in {p.name for p in d.program.outputs}]
    return [name for name in dict.fromkeys([*d.saved_outputs, *extra]) if name in operands]


def _upstream_values(values: dict, d: Derivative, grads, a: torch.Tensor, b: torch.Tensor) -> None:
    """The gradients autograd gives for the outputs, as the backward program's operands."""
    holders = dict(d.upstream_operands)
    for out, grad in zip(d.program.outputs, grads):
        if out.name in holders:
            values[holders[out.name]] = _output_gradient(out, grad, a, b)


def _output_gradient(out, grad, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The gradient autograd gives for output ``out`` of the GEMM of ``a`` and ``b``, as the
    backward reads it (zeros where none reached it): fp32 for a reduction, a tile in the inputs'
    dtype."""
    cols = b.shape[0] * out.node.width.numerator // out.node.width.denominator
    if out.is_reduction:
        shape = a.shape[:-1] if out.axis == "row" else (cols,)
        return (grad if grad is not None else a.new_zeros(shape)).float()
    return (grad if grad is not None else a.new_zeros((*a.shape[:-1], cols))).to(a.dtype).contiguous()


def _weight_gradient(d_acc: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return d_acc.reshape(-1, d_acc.shape[-1]).t() @ x.reshape(-1, x.shape[-1])

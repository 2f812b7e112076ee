"""Programs as PyTorch operators: ``torch.ops.coda_cute.<program>_<fingerprint>`` with fake implementations.

    op = coda_cute.ops.library_op(program)        # registers coda_cute::<name> once
    d, sumsq = op(a, b, residual)                  # operands in program order, then outputs

Each op takes A, B and the program's operands in declaration order (tensors, or floats for
scalars) and returns the outputs in declaration order (tile outputs in their dtype,
reductions finished in fp32).  The fake (meta) implementation gives shapes and dtypes
without running anything, so ``torch.compile(fullgraph=True)`` traces through calls.
On CPU tensors an op runs the reference interpreter with the kernel's layout rules relaxed
(``Kernel(program, strict=False)``), so modules built on these ops train in fp32 on a CPU.
"""

from __future__ import annotations

import inspect
import threading

import torch

from .errors import ProgramError
from .program import Program
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

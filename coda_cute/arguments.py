"""Binding runtime arguments to a program: shapes, dtypes and devices, checked once.

Shared by the reference interpreter and the kernel call path, so both accept and refuse
the same inputs with the same messages.  The GEMM is always ``acc = A @ B.T``:

- ``a``: (..., K); leading dims are batch dims, flattened into M rows;
- ``b``: (N, K), as PyTorch stores a Linear weight (pass ``w.t()`` for ``x @ w``);
- operands by name: RowVec (M,) or (...,), ColVec (width*N,), Tile (M, width*N) or
  (..., width*N), Table (R, P), Scalar a Python number.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import torch

from .errors import ArgumentError
from .program import Program, width_str

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_SHORT = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
TORCH_DTYPES = {v: k for k, v in _SHORT.items()}


def short_dtype(dtype: torch.dtype) -> str:
    return _SHORT.get(dtype, str(dtype).replace("torch.", ""))


@dataclass
class Problem:
    """One call's sizes and normalized operands (vectors 1-D, tiles 2-D)."""

    program: Program
    a: torch.Tensor  # (M, K)
    b: torch.Tensor  # (N, K)
    operands: dict
    batch_shape: tuple

    @property
    def m(self) -> int:
        return self.a.shape[0]

    @property
    def n(self) -> int:
        return self.b.shape[0]

    @property
    def k(self) -> int:
        return self.a.shape[1]

    def cols(self, width: Fraction) -> int:
        """Number of columns of a value living in column space ``width``."""
        return int(self.n * width)

    def storage_dtype(self, dtype: str | None) -> torch.dtype:
        """torch dtype of a cast target or output dtype (None and "in" = the inputs' dtype)."""
        return TORCH_DTYPES[dtype] if dtype not in (None, "in") else self.a.dtype


def bind(program: Program, a: torch.Tensor, b: torch.Tensor, operands: dict | None = None) -> Problem:
    """Check ``a``, ``b`` and the named operands against ``program``; flatten batch dims."""
    operands = dict(operands or {})
    if not isinstance(a, torch.Tensor) or a.dim() < 2:
        raise ArgumentError(f"A must be a tensor of shape (..., K), got {_shape_of(a)}")
    if not isinstance(b, torch.Tensor) or b.dim() != 2:
        raise ArgumentError(f"B must be a 2-D tensor of shape (N, K) (a Linear weight), got {_shape_of(b)}")
    if a.shape[-1] != b.shape[-1]:
        raise ArgumentError(
            f"K mismatch: A is {tuple(a.shape)} (K={a.shape[-1]}) but B is {tuple(b.shape)} (K={b.shape[-1]}); "
            "the GEMM computes A @ B.T, so B must be (N, K)"
        )
    for label, t in (("A", a), ("B", b)):
        if t.dtype not in FLOAT_DTYPES:
            raise ArgumentError(f"{label} has dtype {t.dtype}; expected bfloat16, float16 or float32")
    if a.dtype != b.dtype:
        raise ArgumentError(f"A is {a.dtype} but B is {b.dtype}; both GEMM inputs must have one dtype")
    if a.device != b.device:
        raise ArgumentError(f"A is on {a.device} but B is on {b.device}")
    batch_shape = tuple(a.shape[:-1])
    a2 = a.reshape(-1, a.shape[-1])
    m, n = a2.shape[0], b.shape[0]
    if m == 0 or n == 0 or a.shape[-1] == 0:
        raise ArgumentError(f"empty problem: M={m}, N={n}, K={a.shape[-1]}")

    declared = {op.name for op in program.operands}
    unknown = sorted(set(operands) - declared)
    if unknown:
        raise ArgumentError(
            f"unknown operand(s) {unknown} for program {program.name!r}; its operands are {sorted(declared) or 'none'}"
        )
    bound = {}
    for op in program.operands:
        if op.name not in operands:
            raise ArgumentError(f"program {program.name!r} needs operand {op.name!r} ({op.describe()})")
        bound[op.name] = _bind_operand(op, operands[op.name], batch_shape, m, n, a.device)

    problem = Problem(program, a2, b, bound, batch_shape)
    _check_widths(problem)
    return problem


def _bind_operand(op, value, batch_shape, m, n, device):
    if op.kind == "scalar":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ArgumentError(f"operand {op.name!r} is a Scalar: expected a Python float, got {type(value).__name__}")
        return float(value)
    if not isinstance(value, torch.Tensor):
        raise ArgumentError(f"operand {op.name!r} ({op.describe()}) must be a tensor, got {type(value).__name__}")
    if value.dtype not in FLOAT_DTYPES:
        raise ArgumentError(f"operand {op.name!r} has dtype {value.dtype}; expected bfloat16, float16 or float32")
    if value.device != device:
        raise ArgumentError(f"operand {op.name!r} is on {value.device} but A is on {device}")
    cols = None if op.width is None else n * op.width
    if cols is not None and cols.denominator != 1:
        raise ArgumentError(
            f"operand {op.name!r} is {width_str(op.width)} wide but N={n} is odd: pairwise ops need an even N"
        )
    shape = tuple(value.shape)
    if op.kind == "row":
        if shape not in ((m,), batch_shape):
            raise ArgumentError(f"operand {op.name!r} is a RowVec: expected shape ({m},) (one value per row), got {shape}")
        return value.reshape(m)
    if op.kind == "col":
        if shape != (int(cols),):
            raise ArgumentError(
                f"operand {op.name!r} is a ColVec {width_str(op.width)} wide: expected shape ({int(cols)},), got {shape}"
            )
        return value
    if op.kind == "tile":
        if shape not in ((m, int(cols)), batch_shape + (int(cols),)):
            raise ArgumentError(
                f"operand {op.name!r} is a Tile {width_str(op.width)} wide: expected shape ({m}, {int(cols)}), got {shape}"
            )
        return value.reshape(m, int(cols))
    # table
    if value.dim() != 2 or min(shape) == 0:
        raise ArgumentError(f"operand {op.name!r} is a Table: expected a 2-D tensor (R, P), got shape {shape}")
    return value


def _check_widths(problem: Problem) -> None:
    """Column counts implied by the program's widths must be whole at this N."""
    for node in problem.program.nodes:
        if node.width is None:
            continue
        cols = problem.n * node.width
        if cols.denominator != 1:
            raise ArgumentError(
                f"{node.describe()} pairs adjacent columns, but N={problem.n} is odd: pairwise ops need an even N"
            )
        if node.op == "segreduce" and int(cols) % node.attrs[1]:
            raise ArgumentError(
                f"{node.describe()}: {int(cols)} columns are not a whole number of segments of {node.attrs[1]}"
            )


def _shape_of(x) -> str:
    return f"shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__

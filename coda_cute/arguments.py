"""What a call may pass: runtime arguments checked against a program, once per signature.

``bind`` (shapes, dtypes, devices, scalars, ``out=``) is shared by the reference interpreter and
both call paths; ``check_kernel_arguments`` adds the generated kernel's layout rules (16-bit
A/B, 16-byte aligned rows for TMA).  ``Kernel`` applies both on CUDA tensors, and on CPU
tensors too unless asked not to (``Kernel(program, strict=False)``), so prototyping on a CPU
refuses what the GPU would.  The GEMM is always ``acc = A @ B.T``:

- ``a``: (..., K); leading dims are batch dims, flattened into M rows;
- ``b``: (N, K), as PyTorch stores a Linear weight (pass ``w.t()`` for ``x @ w``);
- operands by name: RowVec (M,) or (...,), ColVec (width*N,), Tile (M, width*N) or
  (..., width*N), Table (R, P), Scalar a Python number;
- ``out``: optional caller tensors for tile outputs, (M, cols) or (..., cols), written in place.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import math

import torch

from .errors import ArgumentError
from .primitives import OPERAND_KINDS
from .program import Program, index_operands, width_str

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: integer dtypes a row or column vector may have (class indices compared with `.col`)
INDEX_DTYPES = (torch.int32,)
_SHORT = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16", torch.int32: "i32"}
TORCH_DTYPES = {v: k for k, v in _SHORT.items()}
#: the largest n with every integer 0..n exact in each float dtype (its significand's reach)
_EXACT_INTEGERS = {torch.float32: 2**24, torch.bfloat16: 2**8, torch.float16: 2**11}


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
    if operands is not None and not isinstance(operands, dict):
        raise ArgumentError(f"operands must be a dict {{name: value}}, got {type(operands).__name__}")
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
    m, n = math.prod(batch_shape), b.shape[0]
    if m == 0 or n == 0 or a.shape[-1] == 0:  # before any reshape, which cannot infer -1 at K = 0
        raise ArgumentError(f"empty problem: M={m}, N={n}, K={a.shape[-1]}")
    a2 = a.reshape(m, a.shape[-1])

    declared = {op.name for op in program.operands}
    unknown = sorted(set(operands) - declared)
    if unknown:
        raise ArgumentError(
            f"unknown operand(s) {unknown} for program {program.name!r}; its operands are {sorted(declared) or 'none'}"
        )
    bound, indices = {}, index_operands(program)
    for op in program.operands:
        if op.name not in operands:
            raise ArgumentError(f"program {program.name!r} needs operand {op.name!r} ({op.describe()})")
        bound[op.name] = _bind_operand(op, operands[op.name], batch_shape, m, n, a.shape[-1], a.device,
                                       op.name in indices)

    problem = Problem(program, a2, b, bound, batch_shape)
    _check_widths(problem)
    _check_indices(problem)
    return problem


def _bind_operand(op, value, batch_shape, m, n, k, device, indices: bool):
    kind = OPERAND_KINDS[op.kind]
    if not kind.is_tensor:
        return kind.bind(op, value, m, None, batch_shape)
    if not isinstance(value, torch.Tensor):
        raise ArgumentError(f"operand {op.name!r} ({op.describe()}) must be a tensor, got {type(value).__name__}")
    if value.dtype not in FLOAT_DTYPES and not (value.dtype in INDEX_DTYPES and indices):
        also = " (int32 for vectors the program compares with .row or .col)" if value.dtype in INDEX_DTYPES else ""
        raise ArgumentError(f"operand {op.name!r} has dtype {value.dtype}; expected bfloat16, float16 or float32{also}")
    if value.device != device:
        raise ArgumentError(f"operand {op.name!r} is on {value.device} but A is on {device}")
    if op.kind == "kvec":
        return kind.bind(op, value, m, k, batch_shape)
    cols = None if op.width is None else n * op.width
    if cols is not None and cols.denominator != 1:
        raise ArgumentError(
            f"operand {op.name!r} is {width_str(op.width)} wide but N={n} is odd: pairwise ops need an even N"
        )
    return kind.bind(op, value, m, None if cols is None else int(cols), batch_shape)


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


def _check_indices(problem: Problem) -> None:
    """A row or column vector compared with ``.row`` / ``.col`` (class indices) must hold every
    index exactly: int32, or a float dtype whose significand reaches the largest index."""
    for name, axes in index_operands(problem.program).items():
        tensor = problem.operands[name]
        exact = _EXACT_INTEGERS.get(tensor.dtype)
        for axis, width in axes:
            count = problem.m if axis == "row" else problem.k if axis == "k" else problem.cols(width)
            if exact is not None and count - 1 > exact:
                what = {"row": "M", "k": "K"}.get(axis, "the columns")
                raise ArgumentError(
                    f"operand {name!r} ({tensor.dtype}) is compared with {axis} indices up to {count - 1}, but "
                    f"{tensor.dtype} holds integers exactly only up to {exact}; pass it as int32 (or float32 while "
                    f"{what} stay within {_EXACT_INTEGERS[torch.float32]})"
                )


def _shape_of(x) -> str:
    return f"shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__


def check_outputs(problem: Problem, given) -> None:
    """Caller-given ``out=`` tensors: known tile outputs, each of its output's dtype, shape
    ((M, cols) or A's leading dims + (cols,)) and device, and writable in place as one (M, cols)
    matrix (a view that would need a copy is refused: the kernel would write the copy)."""
    if given is None:
        return
    if not isinstance(given, dict):
        raise ArgumentError(f"out must be a dict {{output name: tensor}}, got {type(given).__name__}")
    program = problem.program
    names = [o.name for o in program.outputs]
    unknown = [name for name in given if name not in names]
    if unknown:
        raise ArgumentError(f"out= names unknown output(s) {unknown}; outputs are {names}")
    for o in program.reductions:
        if o.name in given:
            raise ArgumentError(f"out[{o.name!r}]: reductions are returned, not written into caller tensors")
    for o in program.tile_outputs:
        if o.name not in given:
            continue
        t, m, cols, dtype = given[o.name], problem.m, problem.cols(o.node.width), problem.storage_dtype(o.dtype)
        if not isinstance(t, torch.Tensor):
            raise ArgumentError(f"out[{o.name!r}] must be a tensor, got {type(t).__name__}")
        shapes = [(m, cols)] + ([problem.batch_shape + (cols,)] if len(problem.batch_shape) != 1 else [])
        if t.dtype != dtype or tuple(t.shape) not in shapes:
            raise ArgumentError(f"out[{o.name!r}] must be {' or '.join(map(str, shapes))} {dtype}, "
                                f"got {tuple(t.shape)} {t.dtype}")
        if t.device != problem.a.device:
            raise ArgumentError(f"out[{o.name!r}] is on {t.device} but A is on {problem.a.device}")
        if t.requires_grad:
            raise ArgumentError(f"out[{o.name!r}] requires grad: outputs written in place are not tracked by autograd")
        try:
            t.view(m, cols)
        except RuntimeError:
            raise ArgumentError(f"out[{o.name!r}] {tuple(t.shape)} with strides {t.stride()} cannot be written in place "
                                f"as ({m}, {cols}): its leading dimensions do not flatten into one; pass a tensor "
                                "whose rows are evenly spaced") from None


def _row_stride_ok(t: torch.Tensor) -> bool:
    return t.stride(-1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0


def _aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0


def check_kernel_arguments(problem: Problem, given: dict | None = None) -> None:
    """Reject, with the operand named, any tensor the generated kernel cannot read or write:
    16-bit A and B with 16-byte aligned rows (so N and K multiples of 8 for contiguous tensors),
    unit-stride vectors and table rows, TMA-ready tile operands, tile outputs whose rows are a
    multiple of 16 bytes, and ``out=`` tensors TMA can store into."""
    a, b = problem.a, problem.b
    if a.dtype not in (torch.bfloat16, torch.float16):
        raise ArgumentError(f"A and B are {a.dtype}; the GPU kernels take bfloat16 or float16 inputs")
    for label, t, dims in (("A", a, "(M, K)"), ("B", b, "(N, K)")):
        unit = [d for d in (0, 1) if t.stride(d) == 1]
        if not unit:
            raise ArgumentError(f"{label} {dims} has strides {t.stride()}: one dimension must be contiguous")
        other = 1 - unit[-1]
        if (t.stride(other) * t.element_size()) % 16:
            raise ArgumentError(
                f"{label} {dims} = {tuple(t.shape)} with strides {t.stride()}: rows must start 16-byte aligned "
                f"(for a contiguous {label}, {'K' if unit[-1] == 1 else dims[1]} must be a multiple of 8)"
            )
        if not _aligned(t):
            raise ArgumentError(f"{label}'s data pointer is not 16-byte aligned (offset view?)")
    if problem.k % 8:
        raise ArgumentError(f"K={problem.k} must be a multiple of 8 (16-byte rows for TMA)")
    for op in problem.program.operands:
        t, kind = problem.operands[op.name], OPERAND_KINDS[op.kind]
        if kind.staging == "ring" and (not _row_stride_ok(t) or not _aligned(t)):
            raise ArgumentError(
                f"operand {op.name!r} (a {kind.annotation}, {tuple(t.shape)}, strides {t.stride()}) must have unit "
                "column stride, 16-byte aligned rows and a 16-byte aligned data pointer"
            )
        if kind.staging in ("vector", "transform") and t.stride(0) != 1 and t.shape[0] > 1:
            raise ArgumentError(f"operand {op.name!r} (a {kind.annotation}, strides {t.stride()}) must be contiguous")
        if kind.staging == "gather" and t.stride(1) != 1 and t.shape[1] > 1:
            raise ArgumentError(f"operand {op.name!r} (a {kind.annotation}, strides {t.stride()}) must have unit "
                                "column stride")
    for o in problem.program.tile_outputs:
        cols = problem.cols(o.node.width)
        dtype = problem.storage_dtype(o.dtype)
        if (cols * torch.tensor([], dtype=dtype).element_size()) % 16:
            raise ArgumentError(
                f"output {o.name!r} is {width_str(o.node.width)} = {cols} columns of {dtype}: rows must be a "
                f"multiple of 16 bytes for TMA stores (N={problem.n})"
            )
        if given and o.name in given:
            t = given[o.name].view(problem.m, cols)
            if not _row_stride_ok(t) or not _aligned(t):
                raise ArgumentError(f"out[{o.name!r}] (strides {given[o.name].stride()}) must have unit column stride, "
                                    "16-byte aligned rows and a 16-byte aligned data pointer")


def random_call(program: Program, m: int, n: int, k: int, dtype: torch.dtype, device="cuda") -> tuple:
    """(A, B, operands): random arguments of ``program`` for an M x N x K problem (A (M, K), B (N,
    K) in ``dtype``; A M-major where an A transform has a token per index of K, as it needs;
    class indices in range where an operand is compared with ``.row`` / ``.col``; rows positive),
    drawn on ``device``: what ``coda-cute tune`` and the benchmarks time."""
    indices, operands = index_operands(program), {}
    for op in program.operands:
        cols = int(n * op.width) if op.width is not None else None
        if op.kind == "scalar":
            operands[op.name] = 1.0
        elif op.name in indices:
            (axis, _), = indices[op.name][:1]
            high = {"row": m, "k": k}.get(axis, cols or n)
            length = {"row": m, "kvec": k}.get(op.kind, cols)
            operands[op.name] = torch.randint(0, high, (length,), dtype=torch.int32, device=device)
        elif op.kind == "kvec":
            operands[op.name] = torch.rand(k, device=device) + 0.5
        elif op.kind == "row":
            operands[op.name] = torch.rand(m, device=device) + 0.5
        elif op.kind == "col":
            operands[op.name] = (torch.rand(cols, device=device) + 0.5).to(dtype)
        elif op.kind == "tile":
            operands[op.name] = torch.randn(m, cols, device=device).to(dtype)
        else:
            operands[op.name] = torch.randn(128, 128, device=device)
    a = (torch.randn(m, k, device=device) / k ** 0.25).to(dtype)
    if program.a_major == "m":
        a = a.t().contiguous().t()  # its classes contiguous, as the logits' transpose is
    b = (torch.randn(n, k, device=device) / k ** 0.25).to(dtype)
    return a, b, operands

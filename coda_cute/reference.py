"""Reference interpreter: runs any program with plain PyTorch (CPU or CUDA).

Ground truth for every kernel test and the CPU fallback.  ``acc = A @ B.T`` is computed
in fp32 with TF32 off; every node is then evaluated in fp32 on whole tensors.

Reduction outputs come back two ways:

- finished (``result.outputs[name]``): shape (M,) for ``axis='row'`` (batch dims
  restored), (width*N,) for ``axis='col'``; reduced directly from the full values;
- per-tile partials (``result.partials[name]``), exactly what a kernel with CTA tile
  (tile_m, tile_n) writes, fp32:
    * row reductions: (T_n, M), T_n = ceil(width*N / (width*tile_n)); entry [t, m] reduces
      row m over the columns of tile t;
    * col reductions: (T_m, width*N), T_m = ceil(M / tile_m); entry [t, c] reduces column
      c over the rows of tile t;
    * logsumexp adds a leading dim of 2: [0] the running max, [1] sum(exp(x - max)).
  ``finish(kind, partials)`` turns partials into the finished values.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from fractions import Fraction

import torch
import torch.nn.functional as F

from .arguments import Problem, bind
from .errors import ArgumentError
from .primitives import A_TRANSFORMS, COMPARISONS, ELEMENTWISE, OPERAND_KINDS
from .program import Node, Program, reads_as_index

_IDENTITY = {"sum": 0.0, "sumsq": 0.0, "max": -math.inf, "maxabs": 0.0}

@dataclass
class ReferenceResult:
    outputs: dict = field(default_factory=dict)
    partials: dict = field(default_factory=dict)
    acc: torch.Tensor | None = None


@contextmanager
def _full_precision_matmul():
    cuda_tf32 = torch.backends.cuda.matmul.allow_tf32
    cudnn_tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = cuda_tf32
        torch.backends.cudnn.allow_tf32 = cudnn_tf32


def evaluate(program: Program, a: torch.Tensor, b: torch.Tensor, operands: dict | None = None,
             *, tile: tuple[int, int] = (128, 128), precision: torch.dtype = torch.float32) -> ReferenceResult:
    """Run ``program`` on ``acc = a @ b.T``; ``tile`` only shapes the reduction partials.

    ``precision=torch.float64`` evaluates every value in fp64 and returns the outputs unrounded
    (in fp64): a check of math, e.g. derived gradients against autograd.  The program's own
    casts (``.to(bf16)`` inside it) still round."""
    return evaluate_problem(bind(program, a, b, operands), tile=tile, precision=precision)


def evaluate_accumulator(program: Program, acc: torch.Tensor, operands: dict | None = None, *,
                         precision: torch.dtype = torch.float32) -> ReferenceResult:
    """Run ``program`` on a given accumulator ``acc`` (M, N) instead of a GEMM's: an elementwise
    pass, e.g. a derived backward applied to a gradient that no GEMM produces."""
    if not isinstance(acc, torch.Tensor) or acc.dim() < 2:
        raise ArgumentError(f"the accumulator must be a tensor of shape (..., N), got {acc!r:.60}")
    n = acc.shape[-1]
    stand_in = acc.new_zeros(()).expand(n, n)  # B of the GEMM that is not run: its shape, no memory
    problem = bind(program, acc, stand_in, operands)
    return evaluate_problem(problem, precision=precision, acc=problem.a)


def evaluate_problem(problem: Problem, *, tile: tuple[int, int] = (128, 128),
                     precision: torch.dtype = torch.float32, acc: torch.Tensor | None = None) -> ReferenceResult:
    """``evaluate`` of arguments already bound (``arguments.bind``); ``acc``: the accumulator itself,
    for ``evaluate_accumulator``."""
    if precision not in (torch.float32, torch.float64):
        raise ValueError(f"precision {precision}: expected torch.float32 (the kernels') or torch.float64")
    program = problem.program
    if acc is not None:
        acc = acc.to(precision)
    else:
        with _full_precision_matmul():
            acc = transformed_a(problem).to(precision) @ problem.b.to(precision).t()
    values = _Evaluator(problem, acc).run()
    result = ReferenceResult(acc=acc)
    exact = precision == torch.float64
    for out in program.outputs:
        value = values[id(out.node)]
        cols = problem.cols(out.node.width)
        full = value.expand(problem.m, cols).to(precision)
        if not out.is_reduction:
            stored = full if exact else full.to(problem.storage_dtype(out.dtype))
            result.outputs[out.name] = stored.reshape(*problem.batch_shape, cols)
            continue
        dim = 1 if out.axis == "row" else 0
        finished = _reduce_dim(full, out.reduce, dim)
        result.outputs[out.name] = finished.reshape(problem.batch_shape) if out.axis == "row" else finished
        tile_len = tile[1] * out.node.width if out.axis == "row" else Fraction(tile[0])
        if tile_len.denominator != 1:
            raise ValueError(f"tile {tile} does not split into whole tiles of width {out.node.width}*N")
        result.partials[out.name] = partials(full, out.reduce, out.axis, int(tile_len))
    return result


def transformed_a(problem: Problem) -> torch.Tensor:
    """A as the product reads it: the program's A transform applied in fp32 (a token per row of
    A, or per index of K) and rounded to A's dtype, as the kernel rounds it in shared memory."""
    program = problem.program
    if program.a_transform is None:
        return problem.a
    transform = A_TRANSFORMS[program.a_transform]
    a = problem.a.float()
    per_row = program.tokens_along == "row"
    tokens = [problem.operands[name].reshape(-1) for name in transform.operands]
    tokens = [t[:, None] if per_row else t[None, :] for t in tokens]
    cls = torch.arange(a.shape[1] if per_row else a.shape[0], device=a.device)
    cls = cls[None, :] if per_row else cls[:, None]
    values = [t.float() if t.is_floating_point() else t for t in tokens]
    return transform.reference(a, cls, *values).to(problem.a.dtype)


class _Evaluator:
    """Every node's value, in the accumulator's precision (fp32, or fp64 for checks of math)."""

    def __init__(self, problem: Problem, acc: torch.Tensor):
        self.p, self.acc, self.values = problem, acc, {}
        self.real = acc.dtype

    def run(self) -> dict:
        for node in self.p.program.nodes:
            self.values[id(node)] = self.eval(node, [self.values[id(x)] for x in node.args])
        return self.values

    def full(self, value: torch.Tensor, width: Fraction) -> torch.Tensor:
        """Expand a value to (M or 1, cols) of column space ``width``; row-constant values
        (scalars, per-row vectors) broadcast into it."""
        value = value.reshape(1, 1) if value.dim() == 0 else value
        return value.expand(value.shape[0], self.p.cols(width))

    def eval(self, node: Node, args: list[torch.Tensor]) -> torch.Tensor:
        p, dev, op = self.p, self.acc.device, node.op
        if op == "acc":
            return self.acc
        if op == "const":
            value = node.attrs[0]
            return torch.tensor(value, dtype=torch.int32 if node.dtype == "i32" else self.real, device=dev)
        if op == "row":
            return torch.arange(p.m, dtype=torch.int32, device=dev)[:, None]
        if op == "col":
            return torch.arange(p.cols(node.width), dtype=torch.int32, device=dev)[None, :]
        if op == "load":
            return self.load(node)
        if op == "cast":
            return args[0].to(p.storage_dtype(node.attrs[0])).to(self.real)
        if op == "pair":
            x = self.full(args[0], node.args[0].width)
            return x[:, node.attrs[0]::2]
        if op == "interleave":
            half = node.width / 2  # either side may be row-constant (a scalar or per-row value)
            even, odd = torch.broadcast_tensors(self.full(args[0], half), self.full(args[1], half))
            return torch.stack([even, odd], dim=-1).reshape(even.shape[0], 2 * even.shape[1])
        if op == "segreduce":
            kind, seg = node.attrs
            x = self.full(args[0], node.width).to(self.real)
            rows, cols = x.shape
            per_segment = _reduce_dim(x.reshape(rows, cols // seg, seg), kind, 2)
            return per_segment.repeat_interleave(seg, dim=1)
        if op in COMPARISONS:  # an int32 operand compared with a coordinate: as integers, exactly
            args = [self.load(arg, as_index=True) if reads_as_index(node, arg) else value
                    for arg, value in zip(node.args, args)]
        return ELEMENTWISE[op].reference(*args)

    def load(self, node: Node, as_index: bool = False) -> torch.Tensor:
        name = node.attrs[0]
        op, value = self.p.program.operand(name), self.p.operands[name]
        if isinstance(value, torch.Tensor) and not (as_index and not value.dtype.is_floating_point):
            value = value.to(self.real)  # operand values are fp32, as in the kernel
        cols = None if op.width is None else self.p.cols(op.width)
        read = OPERAND_KINDS[op.kind].read(value, self.p.m, cols, self.acc.device)
        return read.to(self.real) if read.is_floating_point() else read


def _reduce_dim(x: torch.Tensor, kind: str, dim: int) -> torch.Tensor:
    if kind == "sum":
        return x.sum(dim)
    if kind == "sumsq":
        return (x * x).sum(dim)
    if kind == "max":
        return x.amax(dim)
    if kind == "maxabs":
        return x.abs().amax(dim)
    return torch.logsumexp(x, dim)


def partials(full: torch.Tensor, kind: str, axis: str, tile_len: int) -> torch.Tensor:
    """Per-tile partials of ``full`` (M, cols) in the layout documented above."""
    x = full if axis == "row" else full.t()  # reduce along dim 1 of (items, reduced)
    items, length = x.shape
    tiles = -(-length // tile_len)
    pad = tiles * tile_len - length
    if kind == "logsumexp":
        xp = F.pad(x, (0, pad), value=-math.inf).reshape(items, tiles, tile_len)
        mx = xp.amax(2)
        safe = torch.where(torch.isinf(mx), torch.zeros_like(mx), mx)
        sumexp = torch.exp(xp - safe[..., None]).sum(2)
        return torch.stack([mx.t(), sumexp.t()]).contiguous()
    xp = F.pad(x, (0, pad), value=_IDENTITY[kind]).reshape(items, tiles, tile_len)
    return _reduce_dim(xp, kind, 2).t().contiguous()


def finish(kind: str, parts: torch.Tensor) -> torch.Tensor:
    """Combine per-tile partials (tiles on dim 0, or dim 1 for logsumexp) into final values."""
    if kind in ("sum", "sumsq"):
        return parts.sum(0)
    if kind in ("max", "maxabs"):
        return parts.amax(0)
    mx, sumexp = parts[0], parts[1]
    top = mx.amax(0)
    safe = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    return safe + torch.log((sumexp * torch.exp(mx - safe)).sum(0))

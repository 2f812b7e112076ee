"""The host function of a program's kernel: its arguments in order, each with dtype and shape.

The GEMM is ``acc = A @ B.T``.  The host function takes, in this order: ``a`` (M, K) and ``b``
(N, K); each tile output ``out_<name>`` (M, cols); per reduction its per-tile partials
``part_<name>`` and its finished values ``out_<name>``; where the GEMM finishes them
(``KernelConfig.finish_in_gemm``), ``arrivals``, a counter per tile row and per tile column
(how many tiles have written their partials: the last folds them, and sets the counter back
to 0); each operand ``in_<name>`` (a tensor of its kind's dims, or a float for a Scalar); then
the CUDA stream (not listed here).

Extents are symbols until a call makes them numbers (``Argument.shape``): ``M``, ``N``, ``K``;
a ``Fraction`` w, the columns of a value w * N wide; ``TILES``, the CTA tiles a reduction's
partials run over (along N for a row reduction, along M for a column one); ``2`` (a log-sum-
exp's running max and sum); ``BLOCKS``, the tile rows plus the tile columns; and an operand
kind's free extents (``R``, ``P``, any size; ``P`` baked in where the configuration stages a
table).  Everyone who builds or passes the arguments reads this one list: the lowering (the
host function's parameters and their docs), compile (fake arguments), the runtime's call plan
(what a call allocates and in which order it passes it) and the torch custom op (its outputs'
shapes).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from .config import KernelConfig
from .primitives import OPERAND_KINDS, width_str
from .program import Output, Program

TILES = "TILES"  # the symbol of a partials tensor's tile count
BLOCKS = "BLOCKS"  # the symbol of the arrival counters' count: ceil(M / TILE_M) + ceil(N / TILE_N)


@dataclass(frozen=True)
class Argument:
    """One host argument.  ``role``: 'a', 'b', 'output' (a tile output), 'partials', 'result'
    (a reduction's finished values), 'arrivals' (the reductions' counters), 'operand' or
    'scalar'; ``of``: the program output or operand it belongs to; ``dtype``: its storage
    ('bf16', 'f16', 'f32', 'i32'); ``dims``: its extents as symbols (module docstring)."""

    name: str
    role: str
    of: str | None
    dtype: str
    dims: tuple

    @property
    def is_tensor(self) -> bool:
        return self.role != "scalar"

    def shape(self, m: int, n: int, k: int, tile: tuple[int, int], free: dict | None = None) -> tuple:
        """The extents for a problem of M x N x K run in CTA tiles ``tile``; ``free``: an operand's
        own extents by symbol (R, P), as the call's tensor has them."""
        along_n = self.dims[-1] == "M"  # a row reduction's partials: one per tile along N

        def extent(dim):
            if isinstance(dim, Fraction):  # integer arithmetic: n may be a symbolic size (torch's fake tensors)
                return n * dim.numerator // dim.denominator
            if dim == TILES:
                return -(-n // tile[1]) if along_n else -(-m // tile[0])
            if dim == BLOCKS:
                return -(-m // tile[0]) + -(-n // tile[1])
            if dim in ("M", "N", "K"):
                return {"M": m, "N": n, "K": k}[dim]
            return dim if isinstance(dim, int) else (free or {})[dim]
        return tuple(extent(dim) for dim in self.dims)

    def doc(self) -> str:
        """The parameter's line in the emitted host function's docstring, e.g. 'out_D (M, N) bf16'."""
        if self.role == "scalar":
            return f"{self.name} float"
        if self.role == "partials":
            lead = "2, " if self.dims[0] == 2 else ""
            spread = "ceil(N / TILE_N), M" if self.dims[-1] == "M" else "ceil(M / TILE_M), N"
            return f"{self.name} ({lead}{spread}) f32 partials"
        if self.role == "arrivals":
            return f"{self.name} (ceil(M / TILE_M) + ceil(N / TILE_N),) i32, zeros (the kernel leaves them zero)"
        words = [width_str(d) if isinstance(d, Fraction) else str(d) for d in self.dims]
        if self.role == "result":
            words = ["N"] if words != ["M"] else words  # a column result is N long in words
        shape = f"({words[0]},)" if len(words) == 1 else f"({', '.join(words)})"
        return f"{self.name} {shape} {self.dtype}"


def storage(dtype: str | None, config: KernelConfig) -> str:
    """A tile output's storage dtype: its own, or the inputs' ('in' / None)."""
    return config.dtype if dtype in (None, "in") else dtype


def operand_dtype(config: KernelConfig, name: str) -> str:
    """An operand's storage dtype in this configuration (the inputs' unless the call's differs)."""
    return dict(config.operand_dtypes).get(name, config.dtype)


def reduction_dims(out: Output) -> tuple[tuple, tuple]:
    """(partials' dims, finished values' dims) of a reduction output."""
    length = "M" if out.axis == "row" else out.node.width
    lead = (2,) if out.reduce == "logsumexp" else ()
    return (*lead, TILES, length), (length,)


def host_arguments(program: Program, config: KernelConfig) -> tuple[Argument, ...]:
    """The kernel's host arguments, in the order the host function takes them."""
    args = [Argument("a", "a", None, config.dtype, ("M", "K")), Argument("b", "b", None, config.dtype, ("N", "K"))]
    for out in program.tile_outputs:
        args.append(Argument(f"out_{out.name}", "output", out.name, storage(out.dtype, config), ("M", out.node.width)))
    for out in program.reductions:
        partials, result = reduction_dims(out)
        args.append(Argument(f"part_{out.name}", "partials", out.name, "f32", partials))
        args.append(Argument(f"out_{out.name}", "result", out.name, "f32", result))
    if program.reductions and config.finish_in_gemm:
        args.append(Argument("arrivals", "arrivals", None, "i32", (BLOCKS,)))
    for op in program.operands:
        kind = OPERAND_KINDS[op.kind]
        if not kind.is_tensor:
            args.append(Argument(f"in_{op.name}", "scalar", op.name, "f32", ()))
            continue
        dims = tuple(op.width if d == "W" else d for d in kind.dims)
        args.append(Argument(f"in_{op.name}", "operand", op.name, operand_dtype(config, op.name), dims))
    return tuple(args)

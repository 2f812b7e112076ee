"""Kernel configurations: what a generated kernel is specialized for, checked before rendering.

A ``KernelConfig`` names everything that changes the emitted code besides the program:
target arch and GPU (the SM count is baked into the persistent grid), input dtype,
operand majors, tile and cluster shapes, and the dtypes of the program's tensor operands.
Problem sizes M, N, K stay dynamic: one compile serves every shape with N and K
multiples of 8 (16-byte rows for TMA).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Iterable

from .errors import UnsupportedError
from .program import Program, index_operands

#: Streaming multiprocessors per GPU model (the persistent grid is sized from it).
GPUS = {"H100": 132, "H200": 132, "H800": 132, "H100-PCIe": 114, "H20": 78, "B200": 148, "GB200": 148}
#: the arch each GPU model runs (a kernel is built for one arch and one GPU's SM count)
GPU_ARCHS = {"H100": "sm_90a", "H200": "sm_90a", "H800": "sm_90a", "H100-PCIe": "sm_90a", "H20": "sm_90a",
             "B200": "sm_100a", "GB200": "sm_100a"}
ARCHS = ("sm_90a", "sm_100a")
#: the GPU an arch's kernels are built for where none is named
DEFAULT_GPUS = {"sm_90a": "H200", "sm_100a": "B200"}
INPUT_DTYPES = ("bf16", "f16")
#: dtypes of tensor operands (row/column vectors, tiles, tables)
OPERAND_DTYPES = ("bf16", "f16", "f32", "i32")  # i32: vectors of indices only (resolved() checks)
#: tiles (rows, accumulator columns); on sm_90a one CTA's: cooperative kernels give each 64 rows
#: a consumer warpgroup, up to two, so a 256-row tile's warpgroups hold two 64-row MMA blocks
#: each; on sm_100a a 256-row tile is a CTA pair's (256x256 only there; backends refuse the rest)
TILE_SHAPES = ((128, 256), (256, 128), (128, 192), (128, 128), (128, 64), (64, 256), (64, 128), (256, 256))
CLUSTER_SHAPES = ((1, 1), (2, 1), (1, 2))
SCHEDULES = ("cooperative", "pingpong")
#: tile-order swizzles: bands of this many cluster columns (rows) walked side by side
SWIZZLES = (1, 2, 4, 8)
#: the default: 1-4 % faster than 1 on 9 of 11 ops at d = 4096 on the H200 (results README, 2026-12-03)
DEFAULT_SWIZZLE = 4
SMEM_BYTES = {"sm_90a": 232448, "sm_100a": 232448}  # dynamic shared memory per CTA (227 KB on both)


@dataclass(frozen=True)
class KernelConfig:
    """How to build one kernel.  ``majors`` is A's then B's major dimension: 'k' or 'm' for A
    (A is (M, K)), 'k' or 'n' for B (B is (N, K)); "kk" is the usual ``x @ W.T``."""

    arch: str = "sm_90a"
    gpu: str = "H200"
    dtype: str = "bf16"
    majors: str = "kk"
    tile: tuple[int, int] = (128, 256)
    cluster: tuple[int, int] = (2, 1)
    schedule: str = "cooperative"
    #: order of the persistent tile scheduler: clusters down M first (or across N); a swizzle
    #: walks bands of that many cluster columns (rows) side by side instead (the emitted
    #: kernel's swizzled_tile; the last band is narrower where it does not divide)
    raster_along_m: bool = True
    swizzle: int = DEFAULT_SWIZZLE
    #: mainloop (A/B) stages; 0 = planned: as many as the shared memory left by the epilogue
    #: holds, aiming for AB_STAGES_WANTED (TILE_INPUT_AB_STAGES in cooperative 128x256 kernels
    #: with tile inputs, whose input rings then go a tile deep; lower.py); fewer leave room for
    #: deeper epilogue input rings; a count that does not fit is an error
    ab_stages: int = 0
    #: smem buffers of each epilogue output ring and input ring, subtiles deep; 0 = planned (the
    #: plan gives the mainloop its stages first); a depth must divide the tile's subtile count
    epi_stages: int = 0
    in_stages: int = 0
    operand_dtypes: tuple[tuple[str, str], ...] = field(default=())
    #: Table operands' column periods P, baked in so `col % P` is cheap (unknown: P stays dynamic)
    table_periods: tuple[tuple[str, int], ...] = field(default=())
    #: load each subtile's slice of every table operand into shared memory with TMA, like a tile
    #: input, instead of gathering its elements from global memory: for tables whose rows R are
    #: a multiple of the tile's rows (a tile's rows never wrap) and whose period P is known
    stage_tables: bool = False
    #: reductions: the last tile of each row (column) of tiles folds the partials over the tiles,
    #: instead of a second kernel launched after the GEMM: one launch less per call (4-5 us of
    #: host time), but the folds land in the GEMM's last tiles (a few us more of GPU time);
    #: ``runtime.host_bound`` says which calls use it
    finish_in_gemm: bool = False
    #: the epilogue's subtile loop unrolled while the kernel is traced (sm_90a), instead of a loop
    #: in the IR that LLVM unrolls: mostly the same SASS, in about a third more compile time, but
    #: ptxas allocates the registers otherwise: a heavy ping-pong epilogue can spill from one and
    #: not the other (the SwiGLU backward with h at 128x192: 264 bytes from the IR loop, none
    #: unrolled) or run faster one way.  The runtime unrolls ping-pong kernels of calls that keep
    #: the GPU busy (``unrolled_subtiles``) and tries the other form where one spills
    #: (``cache.default_candidates``)
    unroll_subtiles: bool = False

    def check(self) -> "KernelConfig":
        """Raise UnsupportedError naming the first field this generator cannot build."""
        if not isinstance(self.arch, str) or self.arch not in ARCHS:
            raise UnsupportedError(f"arch {self.arch!r} is not supported; supported: {', '.join(ARCHS)}")
        if not isinstance(self.gpu, str) or self.gpu not in GPUS:
            raise UnsupportedError(f"GPU {self.gpu!r} is unknown; known: {', '.join(GPUS)}")
        if GPU_ARCHS[self.gpu] != self.arch:
            fits = [gpu for gpu, arch in GPU_ARCHS.items() if arch == self.arch]
            raise UnsupportedError(f"GPU {self.gpu!r} runs {GPU_ARCHS[self.gpu]} kernels, not {self.arch}; "
                                   f"name a GPU of {self.arch} ({', '.join(fits)})")
        if not isinstance(self.dtype, str) or self.dtype not in INPUT_DTYPES:
            raise UnsupportedError(f"input dtype {self.dtype!r} is not supported; expected bf16 or f16")
        if not isinstance(self.majors, str) or len(self.majors) != 2 or self.majors[0] not in "km" \
                or self.majors[1] not in "kn":
            raise UnsupportedError(
                f"majors {self.majors!r}: expected A's major ('k' or 'm') then B's ('k' or 'n'), e.g. 'kk'"
            )
        if _pair_of(self.tile) not in TILE_SHAPES:
            raise UnsupportedError(f"tile {self.tile!r} is not supported; choose one of {TILE_SHAPES}")
        if _pair_of(self.cluster) not in CLUSTER_SHAPES:
            raise UnsupportedError(f"cluster {self.cluster!r} is not supported; choose one of {CLUSTER_SHAPES}")
        if not isinstance(self.schedule, str) or self.schedule not in SCHEDULES:
            raise UnsupportedError(f"schedule {self.schedule!r}: expected one of {', '.join(SCHEDULES)}")
        if self.schedule == "pingpong" and self.tile[0] * self.tile[1] > 128 * 192:
            raise UnsupportedError(
                f"tile {self.tile}: ping-pong gives each warpgroup a whole tile, whose fp32 accumulator must fit "
                "192 registers per thread (64x128, 64x256, 128x64, 128x128 or 128x192)"
            )
        if type(self.ab_stages) is not int or self.ab_stages and not 2 <= self.ab_stages <= 8:
            raise UnsupportedError(f"ab_stages {self.ab_stages}: expected 2..8 mainloop stages, or 0 for automatic")
        for name in ("epi_stages", "in_stages"):
            depth = getattr(self, name)
            if type(depth) is not int or depth and not 2 <= depth <= 16:
                raise UnsupportedError(f"{name} {depth!r}: expected 2..16 subtiles, or 0 for planned")
        if type(self.raster_along_m) is not bool:
            raise UnsupportedError(f"raster_along_m {self.raster_along_m!r}: expected True or False")
        if type(self.stage_tables) is not bool:
            raise UnsupportedError(f"stage_tables {self.stage_tables!r}: expected True or False")
        if type(self.finish_in_gemm) is not bool:
            raise UnsupportedError(f"finish_in_gemm {self.finish_in_gemm!r}: expected True or False")
        if type(self.unroll_subtiles) is not bool:
            raise UnsupportedError(f"unroll_subtiles {self.unroll_subtiles!r}: expected True or False")
        if self.unroll_subtiles and self.arch != "sm_90a":
            raise UnsupportedError(f"unroll_subtiles: {self.arch} kernels keep their epilogue's subtile loop rolled; "
                                   "it is an sm_90a choice")
        if type(self.swizzle) is not int or self.swizzle not in SWIZZLES:
            raise UnsupportedError(f"swizzle {self.swizzle!r}: expected one of {', '.join(map(str, SWIZZLES))}")
        for name, dtype in _named_pairs(self.operand_dtypes, "operand_dtypes"):
            if dtype not in OPERAND_DTYPES:
                raise UnsupportedError(f"operand {name!r}: dtype {dtype!r} is not one of {', '.join(OPERAND_DTYPES)}")
        for name, period in _named_pairs(self.table_periods, "table_periods"):
            if type(period) is not int or period <= 0:
                raise UnsupportedError(f"table {name!r}: period {period!r} is not a positive integer")
        return self

    def resolved(self, program) -> "KernelConfig":
        """This config with every tensor operand's dtype spelled out (default: the input dtype)
        and only the program's table periods, in program order: one spelling per kernel, so
        configs that build the same kernel have the same cache key."""
        given = dict(self.operand_dtypes)
        tensors = [op for op in program.operands if op.is_tensor]
        unknown = sorted(set(given) - {op.name for op in tensors})
        if unknown:
            raise UnsupportedError(
                f"operand dtype(s) given for {unknown}, which are not tensor operands of {program.name!r}"
            )
        dtypes = tuple((op.name, given.get(op.name, self.dtype)) for op in tensors)
        indices = index_operands(program)
        for name, dtype in dtypes:
            if dtype not in OPERAND_DTYPES:
                raise UnsupportedError(f"operand {name!r}: dtype {dtype!r} is not one of {', '.join(OPERAND_DTYPES)}")
            if dtype == "i32" and name not in indices:
                raise UnsupportedError(f"operand {name!r}: int32 is for row or column vectors the program compares "
                                       "with .row or .col (indices); use bf16, f16 or f32")
        periods = dict(self.table_periods)
        tables = tuple((op.name, periods[op.name]) for op in tensors if op.staging == "gather" and op.name in periods)
        staged = self.stage_tables and any(op.staging == "gather" for op in tensors)
        return replace(self, operand_dtypes=dtypes, table_periods=tables, stage_tables=staged,
                       finish_in_gemm=self.finish_in_gemm and bool(program.reductions))

    @property
    def sm_count(self) -> int:
        return GPUS[self.gpu]

    def with_(self, **changes) -> "KernelConfig":
        return replace(self, **changes)

    def key(self) -> tuple:
        """Hashable identity, in the order the emitted header prints it."""
        return (self.arch, self.gpu, self.dtype, self.majors, tuple(self.tile), tuple(self.cluster),
                self.schedule, self.raster_along_m, self.swizzle, self.ab_stages, self.epi_stages, self.in_stages,
                tuple(self.operand_dtypes),
                tuple(self.table_periods), self.stage_tables, self.finish_in_gemm, self.unroll_subtiles)

    def describe(self) -> str:
        return (f"{self.arch} {self.gpu} ({self.sm_count} SMs), {self.dtype} inputs, majors {self.majors}, "
                f"tile {self.tile[0]}x{self.tile[1]}, cluster {self.cluster[0]}x{self.cluster[1]}, {self.schedule}"
                + ("" if self.raster_along_m else ", raster along N")
                + f", swizzle {self.swizzle}"
                + (f", {self.ab_stages} mainloop stages" if self.ab_stages else "")
                + (f", output rings {self.epi_stages} deep" if self.epi_stages else "")
                + (f", input rings {self.in_stages} deep" if self.in_stages else "")
                + (", tables staged in smem" if self.stage_tables else "")
                + (", reductions finished in the GEMM" if self.finish_in_gemm else "")
                + (", subtile loop unrolled while tracing" if self.unroll_subtiles else ""))


def unrolled_subtiles(schedule: str, arch: str) -> bool:
    """Whether a kernel of ``schedule`` has its epilogue's subtile loop unrolled while tracing
    (``KernelConfig.unroll_subtiles``) where the runtime chooses: sm_90a ping-pong kernels, whose
    LM-head forward ran 1-6 % slower from the IR loop (H100, benchmarks/results "The subtile loop
    of ping-pong kernels"); calls too small to keep the GPU busy (``runtime.host_bound``) take the
    IR loop, a third quicker to compile, since there the host's time is what counts."""
    return schedule == "pingpong" and arch == "sm_90a"


def _pair_of(value) -> tuple | None:
    """``value`` as a tuple of two ints (tiles, clusters), or None."""
    if isinstance(value, (tuple, list)) and len(value) == 2 and all(type(v) is int for v in value):
        return tuple(value)
    return None


def _named_pairs(items, what: str) -> tuple:
    """``items`` as (name, value) pairs, or an UnsupportedError saying what ``what`` must be."""
    if not isinstance(items, tuple) or not all(isinstance(i, tuple) and len(i) == 2 and isinstance(i[0], str)
                                               for i in items):
        raise UnsupportedError(f"{what} {items!r}: expected a tuple of (operand name, value) pairs")
    return items


def parse_pair(text: str, what: str) -> tuple[int, int]:
    """'128x256' -> (128, 256), with an error naming ``what``."""
    try:
        a, b = (int(x) for x in text.lower().split("x"))
        return a, b
    except ValueError:
        raise UnsupportedError(f"{what} {text!r}: expected two integers like 128x256") from None


def parse_operand_dtypes(program: Program, items: Iterable[str] | None) -> tuple[tuple[str, str], ...]:
    """``NAME=DTYPE`` flags -> ``KernelConfig.operand_dtypes``, checked against ``program`` (the
    CLI's ``--operand-dtype``; ``precompile.precompile`` checks a config's operand dtypes with it too)."""
    tensors = [op.name for op in program.operands if op.kind != "scalar"]
    found: dict[str, str] = {}
    for item in items or ():
        name, sep, dtype = item.partition("=")
        name, dtype = name.strip(), dtype.strip()
        if not sep or not name or not dtype:
            raise UnsupportedError(f"--operand-dtype {item!r}: expected NAME=DTYPE, e.g. residual=f32")
        if name not in tensors:
            scalars = [op.name for op in program.operands if op.kind == "scalar"]
            why = (f"{name!r} is a Scalar (always a runtime float)" if name in scalars
                   else f"program {program.name!r} has no tensor operand {name!r}")
            raise UnsupportedError(f"--operand-dtype {item}: {why}; its tensor operands are: "
                                   f"{', '.join(tensors) or 'none'}")
        if dtype not in OPERAND_DTYPES:
            raise UnsupportedError(f"--operand-dtype {item}: dtype {dtype!r} is not one of {', '.join(OPERAND_DTYPES)}")
        if name in found and found[name] != dtype:
            raise UnsupportedError(f"--operand-dtype gives {name!r} two dtypes ({found[name]} and {dtype})")
        found[name] = dtype
    return tuple(found.items())

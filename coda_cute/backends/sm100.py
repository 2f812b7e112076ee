"""Blackwell (sm_100a): tcgen05 MMAs into tensor memory, one row per epilogue thread.

Compile-verified only: these kernels are compiled and their SASS checked for sm_100a on a
machine without a Blackwell GPU; none has run.  What this first slice does not build is refused.

The kernel.  One CTA per SM computes 128-row tiles (cta_group 1, cluster 1x1) in three roles:
warp 5 loads A and B with TMA, warp 4 issues the tcgen05 MMAs into one of two accumulators in
tensor memory (TMEM), and warps 0-3 run the epilogue of the other accumulator meanwhile.

The fragment scheme.  The epilogue reads the accumulator a 128 x 32 subtile at a time
(tcgen05.ld 32x32b, 32 repetitions): thread t of the 128 epilogue threads holds row t, its
register i column 32 s + i of subtile s.  The pair loop's step k reads registers 2k and 2k + 1
(``acc[slot0]``, ``acc[slot1]``), two adjacent columns of one row.  A thread holds whole rows,
so row reductions need no exchange: each thread writes its row's partial.  No column is held
by one thread, so column reductions would need a scratch exchange this slice does not build.
"""

from __future__ import annotations

from typing import Callable

from ..config import SMEM_BYTES, KernelConfig
from ..errors import UnsupportedError
from ..program import Program
from . import Backend
from . import sm90

EPI_N = 32  # accumulator columns per subtile: one tcgen05.ld 32x32b.x32 per thread
EPI_THREADS = 128  # four epilogue warps, warp w reading TMEM lanes (rows) [32w, 32w + 32)
ACC_STAGES = 2  # accumulators in TMEM: the epilogue of one tile overlaps the next one's MMAs
TMEM_COLUMNS = 512  # a CTA's tensor memory: 128 lanes x 512 32-bit columns
TILES = ((128, 256), (128, 128))  # 128-row tiles (one CTA, cta_group 1), as compiled and tested
AB_STAGES_MAX = 8


class SM100(Backend):
    """The Blackwell backend (see the module's docstring)."""

    arch = "sm_100a"
    capability = (10, 0)
    generation = "Blackwell"
    template = "sm100_gemm.py.j2"
    defaults = ((128, 256), (1, 1), "cooperative")
    acc_lanes = ("acc[slot0]", "acc[slot1]")
    table_slot = "slot0"  # tables are refused (plan_smem)
    row_registers = "1"  # a thread holds one row
    row_register = "0"
    row_sharing = "one thread holds the whole row"
    column_group = "pair0 // 8"
    column_registers = "EPI_N"
    column_sharing = "every thread of the tile"

    def tile_threads(self, config: KernelConfig) -> int:
        return EPI_THREADS

    def schedule(self, config: KernelConfig) -> dict:
        return dict(acc_stages=ACC_STAGES, tmem_columns=TMEM_COLUMNS)

    def plan_smem(self, program: Program, config: KernelConfig, declare: Callable) -> tuple:
        check_supported(program, config)
        ctx = declare(EPI_N)
        too_narrow = [t for t in ctx.tile_outputs if t["cols"] * sm90.DTYPE_BYTES[t["dtype"]] < 16]
        if too_narrow:
            raise UnsupportedError(f"{too_narrow[0]['label']}: a {too_narrow[0]['cols']}-column subtile row is "
                                   "under TMA's 16 bytes")
        subtiles = config.tile[1] // EPI_N
        epi_stages = config.epi_stages or 2
        if subtiles % epi_stages:
            raise UnsupportedError(f"epi_stages {epi_stages}: output rings must divide the tile's {subtiles} "
                                   f"subtiles on {self.arch}")
        ab_bytes = (config.tile[0] + config.tile[1]) * 64 * 2
        room = min((SMEM_BYTES[config.arch] - self.smem_bytes(ctx, epi_stages, 0, 0)) // ab_bytes, AB_STAGES_MAX)
        ab_stages = config.ab_stages or room
        if ab_stages > room or ab_stages < 2:
            raise UnsupportedError(
                f"program {program.name!r} with tile {config.tile[0]}x{config.tile[1]}: {ab_stages} mainloop stages "
                f"do not fit beside its epilogue rings in {config.arch}'s shared memory (room for {room})"
            )
        return ctx, epi_stages, 0, ab_stages

    def smem_bytes(self, ctx, epi_stages: int, in_stages: int, ab_stages: int) -> int:
        # the barriers and TMEM address fit the first 1024 bytes, as Hopper's barriers do; the
        # stages, rings and vectors follow with the same alignments
        return sm90.smem_bytes(ctx, epi_stages, in_stages, ab_stages)

    def coordinates(self, row: bool, col: bool) -> list[str]:
        head = ["row = row0 + ctidx  # this thread's row"] if row else []
        if col:
            head.append("col = col0 + pair0  # the pair's first accumulator column")
        return head

    def row_shuffle(self, value: str) -> str:
        return value  # never exchanged: row_fold runs no step

    def row_fold(self, fold: list[str]) -> list[str]:
        return []

    def row_partials(self, name: str, partial: str, read: list[str], fold: list[str], write: list[str]) -> list[str]:
        return [f"# {name}: this thread holds its whole row: write this tile's {partial}",
                "row = row0 + ctidx",
                "if row < M and col0 < N:",
                *("    " + line for line in read + write)]

    def tile_pairs(self) -> list[str]:
        raise UnsupportedError(f"segment reductions are not lowered to {self.arch} yet")

    def column_slot(self, reg: str, lane: int) -> str:
        raise UnsupportedError(f"column reductions are not lowered to {self.arch} yet")

    def column_exchange(self, kind: str, reg: str, epi_n: int, offset: str = "") -> list[str]:
        raise UnsupportedError(f"column reductions are not lowered to {self.arch} yet")

    def table_gather(self, tables: list[dict], slot: Callable, read: Callable) -> list[str]:
        if tables:
            raise UnsupportedError(f"table operands are not lowered to {self.arch} yet")
        return []


def check_supported(program: Program, config: KernelConfig) -> None:
    """Refuse what this slice of sm_100a does not build, naming it."""
    arch = config.arch
    if tuple(config.tile) not in TILES:
        raise UnsupportedError(f"tile {config.tile[0]}x{config.tile[1]} is not built for {arch} yet; "
                               f"choose one of {', '.join(f'{m}x{n}' for m, n in TILES)}")
    if tuple(config.cluster) != (1, 1):
        raise UnsupportedError(f"cluster {config.cluster[0]}x{config.cluster[1]} is not built for {arch} yet "
                               "(no multicast, no 2-CTA MMA): use cluster 1x1")
    if config.schedule != "cooperative":
        raise UnsupportedError(f"schedule {config.schedule!r} is not built for {arch}: its warp-specialized "
                               "kernel runs the epilogue beside the MMAs already (use cooperative)")
    if ACC_STAGES * config.tile[1] > TMEM_COLUMNS:
        raise UnsupportedError(f"tile {config.tile}: {ACC_STAGES} accumulators exceed {TMEM_COLUMNS} TMEM columns")
    if config.in_stages:
        raise UnsupportedError(f"in_stages {config.in_stages}: {arch} kernels load no tile inputs yet")
    for op in program.operands:
        if op.kind == "tile":
            raise UnsupportedError(f"operand {op.name!r}: tile inputs are not lowered to {arch} yet")
        if op.kind == "table":
            raise UnsupportedError(f"operand {op.name!r}: tables are not lowered to {arch} yet")
    for out in program.reductions:
        if out.axis == "col":
            raise UnsupportedError(f"output {out.name!r}: column reductions are not lowered to {arch} yet")
    for node in program.nodes:
        if node.op == "segreduce":
            raise UnsupportedError(f"{node.describe()}: segment reductions are not lowered to {arch} yet")

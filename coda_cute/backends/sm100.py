"""Blackwell (sm_100a): tcgen05 MMAs into tensor memory, one row per epilogue thread.

Compile-verified only: these kernels are compiled and their SASS checked for sm_100a on a
machine without a Blackwell GPU; none has run.  What it does not build is refused.

The kernel.  One CTA per SM works in three roles: warp 5 loads A and B with TMA, warp 4 issues
the tcgen05 MMAs into one of two accumulators in tensor memory (TMEM), and warps 0-3 run the
epilogue of the other accumulator meanwhile.  A 128-row tile is one CTA's (cta_group 1); in a
cluster of 2 along M (N) its B (A) k-tiles are shared: each CTA loads its half and multicasts
it to both.  A 256-row tile is a CTA pair's (cta_group 2, the cluster 2x1): each CTA loads its
128 rows of A and half of B's columns, the leader's MMA warp issues the MMAs of both, and each
CTA holds its 128 rows of the accumulator in its own TMEM and drains them in its own epilogue.
So an epilogue always covers a 128-row CTA tile (``cta_tile``): the emitted TILE_M, the unit
of the scheduler's tile indices, of row vectors and of the per-tile partials.  A cluster may
own tiles past M or N (the scheduler rounds the tile grid up to whole clusters): their CTAs
still load and multiply (their peers wait for their share), and their stores and partials are
guarded or clipped by TMA, as on Hopper.

The fragment scheme.  The epilogue reads the accumulator a 128 x 32 subtile at a time
(tcgen05.ld 32x32b, 32 repetitions): thread t of the 128 epilogue threads holds row t, its
register i column 32 s + i of subtile s.  The pair loop's step k reads registers 2k and 2k + 1
(``acc[slot0]``, ``acc[slot1]``), two adjacent columns of one row.  A thread holds whole rows,
so row reductions need no exchange: each thread writes its row's partial.  A column is spread
over all 128 threads: a column reduction folds each subtile's 32 per-thread values over the 32
lanes of a warp with halving exchanges (lane l ends with the warp's total of column l), parks
the four warps' totals in ``col_scratch``, and the first 32 threads add them up.

Tile inputs.  A seventh warp (EPI_LOAD_WARP) loads each subtile of every tile input with TMA
into its smem ring (IN_STAGES deep), running ahead of the epilogue; an epilogue thread reads
its row of the subtile from there (N-wide 16-bit inputs copied to registers first, laid out as
the TMEM load lays out the accumulator).

Tables.  Gathered, a table is a per-thread load of its row's entries: one register per column
pair of the subtile and lane, loaded a subtile ahead (``table_gather``).  Staged in smem
(``stage_tables``), it is a tile input whose TMA slice is the table's (row block, column block).

Segment reductions.  A thread holds whole rows, so a segment's reduction needs no exchange:
it runs at the segment's first subtile, thread-local, over the segment's subtiles re-read from
TMEM (``segment_pass``); its one register per row and segment is read by the pair loop of that
segment's subtiles.  Segments narrower than a subtile are reduced from the subtile's registers.
"""

from __future__ import annotations

import re
from typing import Callable

from ..config import SMEM_BYTES, KernelConfig
from ..errors import UnsupportedError
from ..program import Program
from ..spelling import combine
from . import Backend
from . import sm90

EPI_N = 32  # accumulator columns per subtile: one tcgen05.ld 32x32b.x32 per thread
EPI_THREADS = 128  # four epilogue warps, warp w reading TMEM lanes (rows) [32w, 32w + 32)
ACC_STAGES = 2  # accumulators in TMEM: the epilogue of one tile overlaps the next one's MMAs
TMEM_COLUMNS = 512  # a CTA's tensor memory: 128 lanes x 512 32-bit columns
CTA_ROWS = 128  # rows of a CTA's accumulator: TMEM's 128 lanes
# tiles as compiled and tested: 128 rows, one CTA (tcgen05 cta_group 1); 256 rows, a CTA pair
# sharing each MMA (cta_group 2), each CTA holding and draining 128 rows of the accumulator
TILES = ((128, 256), (128, 128), (256, 256), (256, 128))
# clusters (along M, along N): a 1-CTA tile's A is multicast along N, its B along M; a CTA pair
# is a 2x1 cluster, whose CTAs each load half of the tile's B
CLUSTERS = {128: ((1, 1), (2, 1), (1, 2)), 256: ((2, 1),)}
AB_STAGES_MAX = 8
# mainloop stages an input ring deeper than the output rings must leave (unmeasured: no B200 yet;
# Hopper wants 4 too)
AB_STAGES_WANTED = 4
IN_STAGES_CHOICES = (4, 2)  # input ring depths, preferred first (each must divide the subtiles)


class SM100(Backend):
    """The Blackwell backend (see the module's docstring)."""

    arch = "sm_100a"
    capability = (10, 0)
    generation = "Blackwell"
    template = "sm100_gemm.py.j2"
    defaults = ((128, 256), (1, 1), "cooperative")
    # every shape it builds (none measured: no Blackwell GPU has run these kernels)
    tune_shapes = tuple((tile, cluster, "cooperative") for tile in TILES for cluster in CLUSTERS[tile[0]])
    acc_lanes = ("acc[slot0]", "acc[slot1]")
    ring_lanes = ("slot0", "slot1")  # the pair's columns in its subtile's stage
    table_slot = "k"  # the pair's step in the subtile: a table fragment holds one subtile of the row
    row_registers = "1"  # a thread holds one row
    row_register = "0"
    row_sharing = "one thread holds the whole row"
    column_group = "pair0 // 8"
    column_registers = "EPI_N"
    column_sharing = "every thread of the tile"

    def default_cluster(self, tile: tuple[int, int]) -> tuple[int, int]:
        return CLUSTERS[tile[0]][0] if tile[0] in CLUSTERS else tuple(self.defaults[1])  # a pair: 2x1

    def cta_tile(self, tile: tuple[int, int]) -> tuple[int, int]:
        return CTA_ROWS, tile[1]  # a 256-row tile is a CTA pair's: 128 rows each

    def tile_threads(self, config: KernelConfig) -> int:
        return EPI_THREADS

    def schedule(self, config: KernelConfig) -> dict:
        return dict(acc_stages=ACC_STAGES, tmem_columns=TMEM_COLUMNS, cta_group=config.tile[0] // CTA_ROWS)

    def plan_smem(self, program: Program, config: KernelConfig, declare: Callable) -> tuple:
        """Subtiles of EPI_N columns; output rings config.epi_stages deep (2 if not given); input
        rings config.in_stages deep, else the deepest of IN_STAGES_CHOICES that leaves
        AB_STAGES_WANTED mainloop stages (else the shallowest); then as many mainloop stages as
        the rest of the shared memory holds, up to AB_STAGES_MAX (or exactly config.ab_stages)."""
        check_supported(program, config)
        ctx = declare(EPI_N)
        too_narrow = [t for t in ctx.tile_outputs + ctx.tile_inputs if t["cols"] * sm90.DTYPE_BYTES[t["dtype"]] < 16]
        if too_narrow:
            raise UnsupportedError(f"{too_narrow[0]['label']}: a {too_narrow[0]['cols']}-column subtile row is "
                                   "under TMA's 16 bytes")
        subtiles = config.tile[1] // EPI_N
        epi_stages = config.epi_stages or 2
        if subtiles % epi_stages:
            raise UnsupportedError(f"epi_stages {epi_stages}: output rings must divide the tile's {subtiles} "
                                   f"subtiles on {self.arch}")
        if config.in_stages and not ctx.tile_inputs:
            raise UnsupportedError(f"in_stages {config.in_stages}: program {program.name!r} has no tile inputs "
                                   "to load")
        if config.in_stages and subtiles % config.in_stages:
            raise UnsupportedError(f"in_stages {config.in_stages}: input rings must divide the tile's {subtiles} "
                                   f"subtiles on {self.arch}")
        if not ctx.tile_inputs:
            depths = [0]
        else:
            depths = [config.in_stages] if config.in_stages else [d for d in IN_STAGES_CHOICES if subtiles % d == 0]
        ab_bytes = ab_stage_bytes(config)
        for in_stages in depths:
            room = min((SMEM_BYTES[config.arch] - self.smem_bytes(ctx, epi_stages, in_stages, 0)) // ab_bytes,
                       AB_STAGES_MAX)
            if room >= (config.ab_stages or AB_STAGES_WANTED):
                break
        ab_stages = config.ab_stages or room
        if ab_stages > room or ab_stages < 2:
            raise UnsupportedError(
                f"program {program.name!r} with tile {config.tile[0]}x{config.tile[1]}: {ab_stages} mainloop stages "
                f"do not fit beside its epilogue rings in {config.arch}'s shared memory (room for {room})"
            )
        return ctx, epi_stages, in_stages, ab_stages

    def smem_bytes(self, ctx, epi_stages: int, in_stages: int, ab_stages: int) -> int:
        """Hopper's layout (sm90.smem_bytes) over one CTA's share: the barriers and the TMEM
        address in the first 1024 bytes; the A/B stages (this CTA's rows of A, its share of B's
        columns); the 1024-aligned epilogue rings of the CTA's 128 rows; the 16-byte aligned
        small fields (sm90.small_smem_bytes); the whole padded to 1024 bytes."""
        ab = ab_stages * ab_stage_bytes(ctx.config)
        rings = sum(-(-stages * CTA_ROWS * t["cols"] * sm90.DTYPE_BYTES[t["dtype"]] // 1024) * 1024
                    for tiles, stages in ((ctx.tile_outputs, epi_stages), (ctx.tile_inputs, in_stages)) for t in tiles)
        return -(-(1024 + ab + rings + sm90.small_smem_bytes(ctx)) // 1024) * 1024

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

    def segment_registers(self, acc_cols: int, tile_n: int) -> tuple[str, str]:
        # one pass covers one segment of the row, or a subtile's worth of narrower ones
        per_subtile = EPI_N // acc_cols
        return (str(per_subtile), f"slot0 // {acc_cols}") if per_subtile > 1 else ("1", "0")

    def segment_pass(self, acc_cols: int, body: list[str]) -> list[str]:
        """A segment within a subtile reads the subtile's registers.  A wider one is re-read from
        TMEM, a subtile at a time, at its first subtile: keeping its values in registers instead
        (128 for a 128-column head) would need the subtile loop unrolled, which spilled registers
        beside a running log-sum-exp (see the template), and a 32-column TMEM load costs little.
        The pass reads the segment's other subtiles first and this one last, so that ``acc``
        ends holding this subtile again for the pair loop."""
        def reads(name: str) -> bool:
            return any(re.search(rf"\b{name}\b", line.split("#", 1)[0]) for line in body)

        def pairs(subtile: str) -> list[str]:
            columns = [f"pair0 = {subtile} * EPI_N + slot0"] if reads("pair0") or reads("pair1") else []
            columns += ["pair1 = pair0 + 1"] if reads("pair1") else []  # the tile columns, where read
            return ["for k in cutlass.range_constexpr(EPI_N // 2):",
                    "    slot0, slot1 = 2 * k, 2 * k + 1",
                    *("    " + line for line in columns),
                    *("    " + line for line in body)]

        span = acc_cols // EPI_N
        if span <= 1:
            return pairs("subtile")
        return [f"for step in cutlass.range(1, {span + 1}, unroll=1):",
                f"    seg_subtile = subtile + step % {span}  # the segment's next subtiles, this one last",
                "    cute.copy(t2r, tTR_tAcc[(None, None, None, 0, seg_subtile, acc_state.index)], acc)",
                "    cute.arch.fence_view_async_tmem_load()",
                *("    " + line for line in pairs("seg_subtile"))]

    def segment_scope(self, acc_cols: int, label: str, init: list[tuple[str, str]],
                      lines: list[str]) -> tuple[list[str], list[str]]:
        """Registers declared per tile; the reduction at each segment's first subtile, within it."""
        span = acc_cols // EPI_N
        tile = [f"# {label}: registers for the row's current segment", *(declare for declare, _ in init)]
        resets = [reset for _, reset in init]
        if span <= 1:
            return tile, [f"# {label}, within this subtile", *resets, *lines]
        return tile, [f"# {label}, at the segment's first subtile: over its {span} subtiles",
                      f"if subtile % {span} == 0:", *("    " + line for line in resets + lines)]

    def column_slot(self, reg: str, lane: int) -> str:
        return f"{reg}[slot{lane}]"  # register i holds column EPI_N * subtile + i, as acc does

    def column_exchange(self, kind: str, reg: str, epi_n: int, offset: str = "") -> list[str]:
        return lane_column_exchange(kind, reg, epi_n, offset)

    def table_value(self, frag: str, slot: str) -> str:
        return f"{frag}[{slot}]"

    def table_gather(self, tables: list[dict], slot: Callable, read: Callable) -> list[str]:
        """Into the fragments, one entry per column pair of this thread's row (EPI_N // 2).  The
        template runs them for the first subtile before it waits for the accumulator (the row and
        columns are known; the MMAs are still running), for the others once the subtile before
        has read the fragments and issued its store: one buffer, whose loads are in flight across
        the next subtile's TMEM load and barriers (the subtile loop is rolled: a second buffer
        indexed by subtile parity would be a dynamic index into registers, i.e. local memory)."""
        if not tables:
            return []
        lines = ["row = row0 + ctidx",
                 "for k in cutlass.range_constexpr(EPI_N // 2):",
                 "    col = col0 + gather_subtile * EPI_N + 2 * k  # the pair's first accumulator column",
                 f"    table_slot = {self.table_slot}"]
        for t in tables:
            for k, col in enumerate(t["cols"]):
                lines.append(f"    {self.table_value(t['frag'], slot(len(t['cols']), k))} = {read(t['gmem'], col)}")
        return lines


def ab_stage_bytes(config: KernelConfig) -> int:
    """Bytes of one mainloop stage in one CTA: its 128 rows of A and its share of B's columns
    (all of them, or half where a CTA pair shares the MMA), 64 16-bit values along K each."""
    pair = config.tile[0] // CTA_ROWS
    return (CTA_ROWS + config.tile[1] // pair) * 64 * 2


def check_supported(program: Program, config: KernelConfig) -> None:
    """Refuse what sm_100a does not build, naming it."""
    arch = config.arch
    tile, cluster = tuple(config.tile), tuple(config.cluster)
    if tile not in TILES:
        raise UnsupportedError(f"tile {tile[0]}x{tile[1]} is not built for {arch} yet; "
                               f"choose one of {', '.join(f'{m}x{n}' for m, n in TILES)}")
    if cluster not in CLUSTERS[tile[0]]:
        shared = ("a CTA pair shares each MMA (tcgen05 cta_group 2), so its cluster is the pair along M" if tile[0] == 256
                  else "one CTA per tile, A multicast along N or B along M")
        raise UnsupportedError(f"cluster {cluster[0]}x{cluster[1]} is not built for {arch} with tile {tile[0]}x{tile[1]} "
                               f"({shared}): use cluster {' or '.join(f'{m}x{n}' for m, n in CLUSTERS[tile[0]])}")
    if config.schedule != "cooperative":
        raise UnsupportedError(f"schedule {config.schedule!r} is not built for {arch}: its warp-specialized "
                               "kernel runs the epilogue beside the MMAs already (use cooperative)")
    if program.a_transform is not None:
        raise UnsupportedError(f"program {program.name!r} transforms A ({program.a_transform}) as it is loaded; "
                               f"{arch} kernels do not yet (sm_90a kernels do)")
    if ACC_STAGES * config.tile[1] > TMEM_COLUMNS:
        raise UnsupportedError(f"tile {config.tile}: {ACC_STAGES} accumulators exceed {TMEM_COLUMNS} TMEM columns")


def lane_column_exchange(kind: str, reg: str, epi_n: int, offset: str = "") -> list[str]:
    """Lines that fold a subtile's column values (`reg`: EPI_N per thread, value i for column i of
    the subtile, of this thread's row) over the 32 lanes of each warp and store each column's warp
    total in `col_scratch`, from `offset` (an expression; "" for its start).

    Each exchange halves what a thread holds: lanes `step` apart split the values, each keeps one
    half (the upper lane the upper half, moved down), folds in its partner's copy of that half and
    hands over the other.  With 32 values that is 16 + 8 + 4 + 2 + 1 shuffles instead of 32 x 5;
    afterwards value 0 of lane l holds the warp's total of column l (bit b of l picked the upper
    half at the exchange of lanes 2^b apart)."""
    assert epi_n == 32, "one column per lane of a warp"
    lines, kept = [], epi_n
    for step in (16, 8, 4, 2, 1):
        kept //= 2
        mine = f"where(upper, {reg}[k + {kept}], {reg}[k])" if kept > 1 else f"where(upper, {reg}[1], {reg}[0])"
        theirs = f"where(upper, {reg}[k], {reg}[k + {kept}])" if kept > 1 else f"where(upper, {reg}[0], {reg}[1])"
        fold = combine(kind, "mine", f"cute.arch.shuffle_sync_bfly(theirs, offset={step})")
        if kept > 1:
            lines += [f"# lanes {step} apart: the lower keeps values 0-{kept - 1}, the upper {kept}-{2 * kept - 1}",
                      f"upper = (ctidx & {step}) != 0",
                      f"for k in cutlass.range_constexpr({kept}):",
                      f"    mine = {mine}", f"    theirs = {theirs}", f"    {reg}[k] = {fold}"]
        else:
            lines += [f"# lanes {step} apart: the lower keeps value 0, the upper value 1",
                      f"upper = (ctidx & {step}) != 0",
                      f"mine = {mine}", f"theirs = {theirs}", f"{reg}[0] = {fold}"]
    start = offset + " + " if offset else ""
    return lines + ["# lane l holds its warp's total of the subtile's column l",
                    f"col_scratch[{start}(ctidx // 32) * EPI_N + ctidx % 32] = {reg}[0]"]

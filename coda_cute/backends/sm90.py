"""Hopper (sm_90a): WGMMA accumulator fragments, warp-specialized schedules, TMA rings.

The fragment scheme.  A consumer warpgroup's WGMMA accumulator gives each thread, per 64-row MMA
block (``m_block``) and 8-column group ``j``, two rows ``h`` (8 apart) of one column pair
(``acc[pair0]``, ``acc[pair1]``, ``pair = ((e, h, j), m_block, 0)``).  So 4 threads (lanes 1 and
2 apart) share each row, and 8 threads (lanes 4, 8 and 16 apart) each column of a warp: row
reductions fold over 4 lanes with shuffles, column reductions over 8 with halving exchanges
and then over the warps through shared memory (``col_scratch``).
"""

from __future__ import annotations

from typing import Callable

from ..config import SMEM_BYTES, KernelConfig
from ..errors import UnsupportedError
from ..program import Program
from ..spelling import DTYPE_BYTES, combine
from . import Backend

EPI_N_CHOICES = (32, 16)  # accumulator columns per epilogue subtile, preferred first
AB_STAGES_WANTED = 4  # mainloop stages that keep the tensor cores fed (fewer starve them)
# ... except in cooperative 128x256 kernels with tile inputs: 3 stages of 128x256 keep our GEMM as
# fast as 4 (H200, d = 2048 to 8192), so their shared memory goes to the epilogue instead: an
# input ring a tile deep (residual + sumsq 1.20x -> 1.13x our GEMM at d = 2048) or 32-column
# subtiles (RMSNorm backward 1.20x -> 1.16x; 16 columns at 4 stages before) (results, 2026-12-04)
TILE_INPUT_AB_STAGES = 3


class SM90(Backend):
    """The Hopper backend (see the module's docstring)."""

    arch = "sm_90a"
    capability = (9, 0)
    generation = "Hopper"
    template = "sm90_gemm.py.j2"
    # the shapes at which the library's ops measured fastest at one size or another (benchmarks/RESULTS.md)
    tune_shapes = (((128, 256), (1, 2), "cooperative"), ((128, 256), (2, 1), "cooperative"),
                   ((256, 128), (2, 1), "cooperative"), ((128, 192), (1, 2), "pingpong"),
                   ((128, 128), (1, 2), "pingpong"), ((128, 128), (2, 1), "cooperative"))
    acc_lanes = ("acc[pair0]", "acc[pair1]")
    ring_lanes = ("ring_pair0", "ring_pair1")  # the pair in its subtile's stage: ((e, h, group), m_block, 0)
    # a column pair's place among one subtile's pairs in a table fragment: the gather and the body
    # (the template, via render) both index it so
    table_slot = "h + 2 * (m_block + mma_m * group)"
    row_registers = "2 * mma_m"  # two rows (h) per MMA block
    row_register = "m_block * 2 + h"
    row_sharing = "the 4 threads of a row share it"
    column_group = "j"
    column_registers = "EPI_N // 4"  # two columns per 8-column group of the subtile
    column_sharing = "the 8 threads of each column in a warp"

    def tile_threads(self, config: KernelConfig) -> int:
        return tile_threads(config)

    def epilogue_slot(self, config: KernelConfig) -> tuple[int, str]:
        return (2, "consumer_wg") if config.schedule == "pingpong" else (1, "0")

    def schedule(self, config: KernelConfig) -> dict:
        return dict(pingpong=config.schedule == "pingpong", tile_warpgroups=tile_warpgroups(config),
                    **register_split(config))

    def plan_smem(self, program: Program, config: KernelConfig, declare: Callable) -> tuple:
        if tuple(config.tile) == (256, 256):
            raise UnsupportedError(f"tile 256x256 is not built for {self.arch}: its two consumer warpgroups would "
                                   "hold 256 fp32 accumulators per thread (sm_100a builds it, as a CTA pair)")
        return plan_smem(program, config, declare)

    def smem_bytes(self, ctx, epi_stages: int, in_stages: int, ab_stages: int) -> int:
        return smem_bytes(ctx, epi_stages, in_stages, ab_stages)

    def coordinates(self, row: bool, col: bool) -> list[str]:
        head = []
        if row and col:
            head.append("row_in_tile, col_in_tile = tCcAcc[pair0]")
        if row:
            head.append("row = row0 + " + ("row_in_tile" if col else "tCcAcc[pair0][0]"))
        if col:
            first = "col_in_tile" if row else "tCcAcc[pair0][1]"
            head.append(f"col = col0 + {first}  # the pair's first accumulator column")
        return head

    def row_shuffle(self, value: str) -> str:
        return f"cute.arch.shuffle_sync_bfly({value}, offset=offset)"

    def row_fold(self, fold: list[str]) -> list[str]:
        return ["for offset in cutlass.range_constexpr(1, 3):", *("    " + line for line in fold)]

    def segment_registers(self, acc_cols: int, tile_n: int) -> tuple[str, str]:
        # the whole tile at once: one register per row and segment; a tile-wide segment (one per
        # row) needs no column term
        per_tile, groups = tile_n // acc_cols, acc_cols // 8  # 8-column groups j per segment
        if per_tile == 1:
            return self.row_registers, self.row_register
        column = f"{self.column_group} // {groups}" if groups > 1 else self.column_group
        return f"{self.row_registers} * {per_tile}", f"({self.row_register}) * {per_tile} + {column}"

    def segment_pass(self, acc_cols: int, body: list[str]) -> list[str]:
        """Every pair of the whole tile: the accumulator is in registers."""
        return ["for m_block in cutlass.range_constexpr(mma_m):",
                "    for j in cutlass.range_constexpr(TILE_N // 8):",
                "        for h in cutlass.range_constexpr(2):",
                "            pair0 = ((0, h, j), m_block, 0)",
                "            pair1 = ((1, h, j), m_block, 0)",
                *("            " + line for line in body)]

    def segment_scope(self, acc_cols: int, label: str, init: list[tuple[str, str]],
                      lines: list[str]) -> tuple[list[str], list[str]]:
        """All in the tile's prologue, before the subtiles."""
        return [f"# {label}, over the whole tile", *(line for pair in init for line in pair), *lines], []

    def column_slot(self, reg: str, lane: int) -> str:
        return f"{reg}[group * 2{f' + {lane}' if lane else ''}]"

    def row_partials(self, name: str, partial: str, read: list[str], fold: list[str], write: list[str]) -> list[str]:
        return [f"# {name}: combine the 4 threads of each row, write this tile's {partial}",
                "for m_block in cutlass.range_constexpr(mma_m):",
                "    for h in cutlass.range_constexpr(2):",
                *("        " + line for line in read),
                *("        " + line for line in self.row_fold(fold)),
                "        row = row0 + tCcAcc[((0, h, 0), m_block, 0)][0]",
                "        if ctidx % 4 == 0 and row < M and col0 < N:  # a cluster may own a tile past N: no partial",
                *("            " + line for line in write)]

    def column_exchange(self, kind: str, reg: str, epi_n: int, offset: str = "") -> list[str]:
        return warp_column_exchange(kind, reg, epi_n, offset)

    def table_value(self, frag: str, slot: str) -> str:
        return f"{frag}[({slot}, subtile % 2)]"

    def table_gather(self, tables: list[dict], slot: Callable, read: Callable) -> list[str]:
        """Into stage ``gather_subtile % 2`` of each table's register fragment.  The template runs
        them before the values are needed: for the first subtile while the mainloop's last WGMMAs finish, for
        the others once the subtile before has issued its store, so the loads' latency hides
        behind the barriers in between.  (Loaded where they were used, their latency was most of
        RoPE's epilogue in Nsight Compute.)"""
        if not tables:
            return []
        lines = ["gather_stage = gather_subtile % 2  # the fragments' stage for that subtile",
                 "for m_block in cutlass.range_constexpr(mma_m):",
                 "    for group in cutlass.range_constexpr(EPI_N // 8):",
                 "        j = gather_subtile * (EPI_N // 8) + group",
                 "        for h in cutlass.range_constexpr(2):",
                 "            row_in_tile, col_in_tile = tCcAcc[((0, h, j), m_block, 0)]",
                 "            row = row0 + row_in_tile",
                 "            col = col0 + col_in_tile",
                 f"            table_slot = {self.table_slot}"]
        for t in tables:
            for k, col in enumerate(t["cols"]):
                target = f"{t['frag']}[({slot(len(t['cols']), k)}, gather_stage)]"
                lines.append(f"            {target} = {read(t['gmem'], col)}")
        return lines


def register_split(config: KernelConfig) -> dict:
    """Registers per thread of the producer and of each consumer warpgroup after setmaxnreg.
    Their sum over the CTA must stay within its launch pool (168 x 384 threads = 64512): a
    consumer asking for more than the producer gave back waits forever.  Ping-pong gives each
    consumer a whole tile (up to 192 fp32 accumulators per thread): the producer, which only
    issues TMA copies, goes down to 24 so that each consumer can have 240."""
    if config.schedule == "pingpong":
        return dict(producer_regs=24, consumer_regs=240)
    return dict(producer_regs=40, consumer_regs=232)


def mma_blocks(config: KernelConfig) -> int:
    """64-row MMA blocks per consumer thread (`mma_m` in the kernel)."""
    return config.tile[0] // 64 // tile_warpgroups(config)


def tile_warpgroups(config: KernelConfig) -> int:
    """Warpgroups that compute one tile: one (ping-pong), else one per 64 rows, at most two (a
    256-row tile gives each two 64-row blocks, rows [64w, 64w + 64) of each 128)."""
    return 1 if config.schedule == "pingpong" else min(config.tile[0] // 64, 2)


def tile_threads(config: KernelConfig) -> int:
    """Threads that compute one tile."""
    return 128 * tile_warpgroups(config)


def plan_smem(program: Program, config: KernelConfig, declare: Callable) -> tuple:
    """Pick the epilogue subtile width and the stage counts that fit the SM's shared memory:
    (context, EPI_STAGES, IN_STAGES, AB_STAGES).

    The mainloop needs about AB_STAGES_WANTED stages in flight (TILE_INPUT_AB_STAGES in a
    cooperative 128x256 kernel with tile inputs; or exactly config.ab_stages);
    the epilogue rings share the same memory: output rings of EPI_STAGES subtiles, input rings
    of IN_STAGES subtiles.  Inputs are loaded by their own warp, which runs ahead into the next
    tile while the mainloop computes; the deeper their ring, the less the epilogue waits on
    memory (see _stages for who gets how much).  Subtiles of 32 accumulator columns are
    preferred; programs with wide rings (2N outputs or inputs) take 16 columns when that buys
    mainloop stages.  A warpgroup holding two MMA blocks per thread (ping-pong with 128 rows,
    cooperative with 256) has twice the per-subtile registers: it prefers 16 columns.  A
    cooperative 128x256 kernel with tile inputs and no stage counts given first tries input
    rings a whole tile deep beside TILE_INPUT_AB_STAGES mainloop stages: its epilogue then never
    waits for an input."""
    tile_inputs = any(op.staging == "ring" for op in program.operands)
    if config.in_stages and not tile_inputs:
        raise UnsupportedError(f"in_stages {config.in_stages}: program {program.name!r} has no tile inputs to load")
    tile_inputs_128x256 = tile_inputs and config.schedule == "cooperative" and tuple(config.tile) == (128, 256)  # as measured
    if tile_inputs_128x256 and not (config.ab_stages or config.in_stages):
        # the whole tile's inputs in flight, beside TILE_INPUT_AB_STAGES mainloop stages
        best, _ = _best_plan(config, declare, TILE_INPUT_AB_STAGES, deep_inputs=True)
        if best is not None:
            return best
    wanted = config.ab_stages or (TILE_INPUT_AB_STAGES if tile_inputs_128x256 else AB_STAGES_WANTED)
    best, narrow = _best_plan(config, declare, wanted)
    if best is None and len(narrow) == len(EPI_N_CHOICES):  # no subtile width TMA can move
        raise UnsupportedError(f"{narrow[-1]['label']}: a {narrow[-1]['cols']}-column subtile row is under TMA's 16 bytes")
    if best is None and (config.epi_stages or config.in_stages):
        rings = ", ".join(f"{what} rings {depth} subtiles deep" for what, depth in
                          (("output", config.epi_stages), ("input", config.in_stages)) if depth)
        raise UnsupportedError(
            f"program {program.name!r} with tile {config.tile[0]}x{config.tile[1]}: {rings} do not fit beside "
            f"{config.ab_stages or 2} mainloop stages in {config.arch}'s shared memory, or do not divide the tile's "
            f"{config.tile[1] // 32} (or {config.tile[1] // 16}) subtiles; choose shallower rings or leave them planned (0)"
        )
    if best is None and config.ab_stages:
        raise UnsupportedError(
            f"program {program.name!r} with tile {config.tile[0]}x{config.tile[1]}: {config.ab_stages} mainloop stages "
            f"do not fit beside its epilogue rings in {config.arch}'s shared memory; choose fewer stages (ab_stages) "
            "or a smaller tile"
        )
    if best is None:
        raise UnsupportedError(
            f"program {program.name!r} with tile {config.tile[0]}x{config.tile[1]} needs more shared memory than "
            f"{config.arch} has for its epilogue tiles; choose a smaller tile"
        )
    return best


def _best_plan(config: KernelConfig, declare: Callable, wanted: int, deep_inputs: bool = False) -> tuple:
    """(the best (context, EPI_STAGES, IN_STAGES, AB_STAGES) over the subtile widths, or None;
    the tiles that were too narrow for TMA at each width that had one).  Mainloop stages (up to
    `wanted`) rank first, then the preferred subtile width (16 columns with deep input rings
    spilled registers in the kernels with column reductions)."""
    best, best_rank, narrow = None, None, []
    choices = EPI_N_CHOICES[::-1] if mma_blocks(config) > 1 else EPI_N_CHOICES
    if deep_inputs:  # the preferred width only: rmsnorm_bwd's tile-deep ring at 16 columns spilled
        choices = choices[:1]
    for preference, epi_n in enumerate(choices):
        ctx = declare(epi_n)
        too_narrow = [t for t in ctx.tile_outputs + ctx.tile_inputs if t["cols"] * DTYPE_BYTES[t["dtype"]] < 16]
        if too_narrow:
            narrow.append(too_narrow[0])
            continue  # a subtile row under TMA's 16 bytes
        stages = _stages(ctx, config, wanted, deep_inputs)
        if stages is None:
            continue
        rank = (min(stages[2], wanted), -preference)
        if best is None or rank > best_rank:
            best, best_rank = (ctx, *stages), rank
    return best, narrow


def smem_bytes(ctx, epi_stages: int, in_stages: int, ab_stages: int) -> int:
    """Bytes of the kernel's SharedStorage (see the template): barriers, padded to the 1024-byte
    alignment of the A/B stages, then the A/B stages, the epilogue rings (1024-aligned; outputs
    of epi_stages subtiles, inputs of in_stages) and the small fields (small_smem_bytes); the
    whole struct is padded to its 1024-byte alignment.  A test compares this with the compiled
    struct's size."""
    tile_m, tile_n = ctx.config.tile
    ab = ab_stages * (tile_m + tile_n) * 64 * 2
    rings = sum(-(-stages * tile_m * t["cols"] * DTYPE_BYTES[t["dtype"]] // 1024) * 1024
                for tiles, stages in ((ctx.tile_outputs, epi_stages), (ctx.tile_inputs, in_stages)) for t in tiles)
    return -(-(1024 + ab + rings + small_smem_bytes(ctx)) // 1024) * 1024


def small_smem_bytes(ctx) -> int:
    """The 16-byte aligned fields after the rings: per-tile vectors and column-reduction scratch
    (4-byte elements).  (The finishing flags sit in the barriers' 1024 bytes.)"""
    return sum(-(-4 * n // 16) * 16 for n in [v["elems"] for v in ctx.vectors] + [ctx.col_scratch_elems])


def _stages(ctx, config: KernelConfig, wanted: int, deep_inputs: bool = False) -> tuple[int, int, int] | None:
    """(EPI_STAGES, IN_STAGES, AB_STAGES) for this subtile width, or None when they do not fit.

    Automatic (config.ab_stages 0): input rings as deep as the output rings, 4 over 2, with at
    least `wanted` mainloop stages (else the last choice and whatever remains, at least 2), then
    as many mainloop stages as the rest holds, up to 8: the plan measured on the H200.  With
    config.ab_stages given, exactly that many mainloop stages (None when they do not fit), and
    the input rings take the deepest ring (a divisor of the subtile count) that fits beside them.
    With `deep_inputs`, input rings a whole tile deep and at least `wanted` mainloop stages, or
    None.  A ring depth given (config.epi_stages, config.in_stages) is the only choice for its
    rings; it must divide the subtile count."""
    subtiles = config.tile[1] // ctx.epi_n
    budget = SMEM_BYTES[config.arch]
    ab_bytes = (config.tile[0] + config.tile[1]) * 64 * 2
    outs = [config.epi_stages] if config.epi_stages else [4, 2]
    if config.in_stages:
        pairs = [(epi, config.in_stages) for epi in outs]
    elif deep_inputs:
        pairs = [(epi, subtiles) for epi in outs]
    elif config.ab_stages and ctx.tile_inputs:  # the deepest input ring first
        pairs = [(epi, deep) for deep in range(subtiles, 1, -1) if subtiles % deep == 0 for epi in outs]
    else:
        pairs = [(epi, epi) for epi in outs]
    for epi_stages, in_stages in pairs:
        if subtiles % epi_stages or (ctx.tile_inputs and subtiles % in_stages):
            continue
        room = min((budget - smem_bytes(ctx, epi_stages, in_stages, 0)) // ab_bytes, 8)
        ab_stages = min(room, config.ab_stages) if config.ab_stages else room
        fallback = not (config.ab_stages or deep_inputs) and (epi_stages, in_stages) == pairs[-1] and ab_stages >= 2
        if ab_stages >= wanted or fallback:
            return epi_stages, in_stages, ab_stages
    return None



def warp_column_exchange(kind: str, reg: str, epi_n: int, offset: str = "") -> list[str]:
    """Lines that fold a subtile's column values (`reg`, EPI_N // 4 per thread) over the 8 threads
    sharing each column (lanes 4 apart) and store each column's warp total in `col_scratch`,
    from `offset` (an expression; "" for its start).

    Each exchange halves what a thread holds: lanes `step` apart split the values, each keeps one
    half, folds in its partner's copy of that half, and hands over the other.  With 8 values that
    is 4 + 2 + 1 shuffles instead of 8 x 3, and afterwards every lane holds a different column:
    value lane // 4.  With 4 values, the last step (lanes 4 apart) folds the one value left and
    both lanes hold it; the lower one stores it."""
    def exchange(low: str, high: str, step: int) -> list[str]:  # the lower lane keeps `low`, the upper `high`
        return [f"mine = where(upper, {reg}[{high}], {reg}[{low}])",
                f"theirs = where(upper, {reg}[{low}], {reg}[{high}])",
                f"{reg}[{low}] = {combine(kind, 'mine', f'cute.arch.shuffle_sync_bfly(theirs, offset={step})')}"]

    values = epi_n // 4
    lines, kept = [], values
    for step in (16, 8, 4):
        kept //= 2
        if kept:
            if kept == 1:
                lines += [f"# lanes {step} apart: the lower keeps value 0, the upper value 1",
                          f"upper = (ctidx & {step}) != 0", *exchange("0", "1", step)]
            else:
                lines += [f"# lanes {step} apart: the lower keeps values 0-{kept - 1}, the upper {kept}-{2 * kept - 1}",
                          f"upper = (ctidx & {step}) != 0",
                          f"for k in cutlass.range_constexpr({kept}):",
                          *("    " + line for line in exchange("k", f"k + {kept}", step))]
        else:
            lines += [f"# lanes {step} apart hold the same column now: both fold it",
                      f"{reg}[0] = {combine(kind, f'{reg}[0]', f'cute.arch.shuffle_sync_bfly({reg}[0], offset={step})')}"]
    spread = 32 // values  # lanes holding the same value index
    place = [f"value = ctidx % 32 // {spread}  # which of this thread's values it now holds",
             "# its value k lies 8 * (k // 2) + k % 2 columns past its first (the WGMMA fragment)",
             "col_in_subtile = tCcAcc[((0, 0, subtile * (EPI_N // 8)), 0, 0)][1] - subtile * EPI_N + 8 * (value // 2) + value % 2",
             f"col_scratch[{offset + ' + ' if offset else ''}(ctidx // 32) * EPI_N + col_in_subtile] = {reg}[0]"]
    if spread > 4:
        place = [f"if ctidx % {spread} < 4:", *("    " + line for line in place)]
    return lines + place


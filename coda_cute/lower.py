"""Lowering a validated program to the context of its arch's template.

The program's values become code here, the same on every arch; where the code meets the
kernel's layout (the accumulator's lanes and coordinates, the threads that share a row or a
column, the shared-memory plan) it asks the backend of ``config.arch`` (``backends``).

The epilogue works on one column pair of one row at a time: accumulator columns
(col, col + 1) of row ``row``, held by one thread (on sm_90a ``acc[pair0]``, ``acc[pair1]``).
Every program value becomes a few scalar *lanes* there, by its width:

    N/2 wide  -> 1 lane  (the pair)                 row-constant -> 1 lane
    N wide    -> 2 lanes (col, col + 1)             2N wide      -> 4 lanes (2col .. 2col + 3)

so pairs()/interleave() only rename lanes and move no data.  Each node is emitted as
one assignment per lane, commented with the program value it computes.

Names built from user input get fixed prefixes the template never uses itself:
``in_<operand>``, ``out_<output>``, ``part_<reduction>`` (its per-tile partials),
``smem_in_/smem_out_``, ``view_in_/view_out_``, ``tma_in_/tma_out_``, ``red_<reduction>``
and ``v_<value>``.  No prefix is the start of another, and names derived from those
append ``__`` and a word (``tma_out_D__tensor``, ``red_lse__max``), which user names may
not contain (``program.check_name``): so no two user names give the same emitted name.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from fractions import Fraction

from .backends.registry import backend
from .config import SMEM_BYTES, KernelConfig
from .errors import UnsupportedError
from .primitives import A_TRANSFORMS, ELEMENTWISE
from .program import Node, Program, reads_as_index, width_str
from .signature import host_arguments, operand_dtype, storage
from .spelling import CUTE_DTYPES, DTYPE_BYTES, IDENTITY, combine, reduce_term

HALF, ONE, TWO = Fraction(1, 2), Fraction(1), Fraction(2)
NUM_LANES = {None: 1, HALF: 1, ONE: 2, TWO: 4}


@dataclass
class Context:
    """Everything the template needs; built by ``lower``."""

    program: Program
    config: KernelConfig  # resolved: every operand dtype spelled out
    cfg: dict
    class_name: str
    host_params: list = field(default_factory=list)
    kernel_params: list = field(default_factory=list)
    kernel_param_decls: list = field(default_factory=list)
    tile_outputs: list = field(default_factory=list)
    tile_inputs: list = field(default_factory=list)
    vectors: list = field(default_factory=list)
    views: list = field(default_factory=list)
    # the A transform (sm90_mainloop.py.j2): its name, where tokens run ('row' or 'k'), its operands' kernel names
    a_transform: dict | None = None
    body: list = field(default_factory=list)
    tile_prologue: list = field(default_factory=list)
    subtile_prologue: list = field(default_factory=list)
    subtile_compute_end: list = field(default_factory=list)
    subtile_epilogue: list = field(default_factory=list)
    tile_epilogue: list = field(default_factory=list)
    # reductions' arrival counts and folds (_finish): before the tile loop, at a tile's start, at its
    # end, after the loop
    finish_init: list = field(default_factory=list)
    finish_start: list = field(default_factory=list)
    finish_decide: list = field(default_factory=list)  # at the end of the first subtile
    finish_end: list = field(default_factory=list)
    finish_tail: list = field(default_factory=list)
    finish_axes: list = field(default_factory=list)  # 'row', 'col': which counters the program's reductions use
    col_reductions: list = field(default_factory=list)
    finishes: list = field(default_factory=list)  # reductions: their partials and how they are folded
    finish_epilogues: int = 0  # epilogues a CTA runs at once, each with its finish_state words
    col_scratch_elems: int = 0
    segments: list = field(default_factory=list)  # registers of segment reductions
    subtile_segments: list = field(default_factory=list)  # segment reductions run at a segment's first subtile
    tables: list = field(default_factory=list)  # table operands gathered a subtile ahead
    epi_n: int = 0  # accumulator columns per epilogue subtile: the backend's plan picks them
    helpers: set = field(default_factory=set)  # module-level helper functions the body calls

    epi_load_bytes: int = 0
    call_signature: str = ""

    @property
    def fast_tiles(self) -> bool:
        return any(t["fast"] for t in self.tile_outputs + self.tile_inputs)

    @property
    def inputs_in_registers(self) -> bool:
        """Whether every epilogue tile input is copied into registers (ldmatrix) at the start of a
        subtile, so its smem stage can be freed before the subtile computes.  Cooperative kernels
        only: in ping-pong ones the early release left rmsnorm_bwd(_residual) spilling (160-636
        bytes), and their epilogue overlaps the other warpgroup's WGMMAs anyway."""
        return (bool(self.tile_inputs) and all(t["fast"] for t in self.tile_inputs)
                and self.config.schedule == "cooperative")

    def uses(self, name: str) -> bool:
        """Whether the generated lines refer to ``name``: the template defines the tile's
        coordinates (``tCcAcc``, ``row0``, ``col0``) and the view helpers only where used."""
        lines = (self.body + self.tile_prologue + self.subtile_segments + self.subtile_prologue + self.subtile_compute_end
                 + self.subtile_epilogue + self.tile_epilogue + self.table_gather()
                 + self.finish_init + self.finish_start + self.finish_decide + self.finish_end + self.finish_tail
                 + [str(x) for x in self.vectors + self.views])
        return _refers_to(lines, name)

    def table_gather(self) -> list[str]:
        """Lines that load subtile ``gather_subtile``'s table values into their register
        fragments (the backend's gather; the template runs them a subtile ahead)."""
        return backend(self.config.arch).table_gather(self.tables, _table_slot, _table_read)


def _table_slot(lanes: int, k: int) -> str:
    """Fragment row of lane ``k`` of a pair's ``lanes`` table values."""
    return "table_slot" if lanes == 1 else f"{lanes} * table_slot + {k}"


def _table_read(table: str, col: str) -> str:
    """One element of a table operand, T[row % R, col % P], as fp32.  The row is indexed first,
    then the column: the row's address is computed once per row and each column adds a 32-bit
    offset (indexing both at once made 64-bit address math per element)."""
    return f"cutlass.Float32({table}[(row % {table}.shape[0], None)][({col}) % {table}.shape[1]])"


def lower(program: Program, config: KernelConfig) -> Context:
    """Check that ``program`` can run as an epilogue of ``config.arch`` under ``config``; build the
    context."""
    config = config.check().resolved(program)
    target = backend(config.arch)
    _check_supported(program, config)
    tile_m, tile_n = target.cta_tile(config.tile)  # one CTA's share: what TILE_M and TILE_N name
    ctx, stages, in_stages, ab_stages = _plan_smem(program, config)
    ctx.cfg = dict(
        arch=config.arch, gpu=config.gpu, sm_count=config.sm_count,
        ab_dtype=CUTE_DTYPES[config.dtype],
        a_major=config.majors[0].upper(), b_major=config.majors[1].upper(),
        a_layout="ROW_MAJOR" if config.majors[0] == "k" else "COL_MAJOR",
        b_layout="ROW_MAJOR" if config.majors[1] == "k" else "COL_MAJOR",
        tile_m=tile_m, tile_n=tile_n, tile_k=64, cluster_m=config.cluster[0], cluster_n=config.cluster[1],
        ab_stages=ab_stages, epi_n=ctx.epi_n, epi_stages=stages, in_stages=in_stages,
        smem_budget=SMEM_BYTES[config.arch], smem_planned=target.smem_bytes(ctx, stages, in_stages, ab_stages),
        raster_along_m=config.raster_along_m, swizzle=config.swizzle, finish_in_gemm=config.finish_in_gemm,
        unroll_subtiles=config.unroll_subtiles,
        **target.schedule(config),
    )
    _Body(ctx, program, config).emit_all()
    _finish(ctx, config)
    names = ["a (M, K)", "b (N, K)"] + [p["doc"] for p in ctx.host_params] + ["stream"]
    ctx.call_signature = ", ".join(names)
    return ctx


def _finish(ctx: Context, config: KernelConfig) -> None:
    """Where ``config.finish_in_gemm``, reductions are finished in the GEMM kernel: each tile
    whose partials are written counts itself in (``arrivals``: a counter per row of tiles, then
    one per column of tiles), and the last tile of a row (column) folds that row's (column's)
    partials (finish_in_gemm.py.j2).  One tile behind, so that no thread waits on the memory
    system: a tile is counted in at the start of the next tile's epilogue, when its partials
    have long been written (the release fence has nothing to wait for), and learns whether it
    was the last after that epilogue's first subtile (the count has come back meanwhile); a
    tile that was the last folds at the epilogue's end, where the accumulators are no longer
    needed, so the fold takes registers from no one.  What one tile tells the next sits in
    smem (``finish_state``), not in registers; the last tile is settled after the tile loop.
    Otherwise a second kernel finishes them (finish_kernel.py.j2)."""
    if not ctx.finishes or not config.finish_in_gemm:
        return
    ctx.finish_axes = [axis for axis in ("row", "col") if any(f["axis"] == axis for f in ctx.finishes)]
    ctx.finish_epilogues, slot = backend(config.arch).epilogue_slot(config)
    state = lambda word: f"finish_state[({word}, {slot})]"  # noqa: E731
    flag, counted_m, counted_n, written_m, written_n = (state(w) for w in range(5))
    partials = ", ".join(f"{f['part']}, {f['out']}" for f in ctx.finishes)
    ctx.finish_init = [
        "# reductions, one tile behind (finish_in_gemm.py.j2): the counts of the tile counted in",
        "# at this tile's start; in finish_state: that tile, and this one once it has written its",
        "# partials",
        "counted_rows, counted_cols = cutlass.Int32(0), cutlass.Int32(0)",
        "if ctidx == COUNTING_THREAD:",
        f"    {written_m} = -1  # none yet"]
    ctx.finish_start = [
        "# reductions: count in the last tile",
        "epilogue_barrier.arrive_and_wait()  # its partials are all written",
        "if ctidx == COUNTING_THREAD:",
        f"    {counted_m}, {counted_n} = {written_m}, {written_n}",
        f"    if {written_m} >= 0:",
        f"        counted_rows, counted_cols = self.count_in(arrivals, {written_m}, {written_n}, M)"]
    ctx.finish_decide = [
        "# reductions: was the tile counted in at this tile's start the last of its row (column)",
        "# of tiles?  (Asked here, a subtile on: its count has come back, and holds a register no longer)",
        "if ctidx == COUNTING_THREAD:",
        f"    {flag} = 0",
        f"    if {counted_m} >= 0:",
        f"        {flag} = self.last_of(arrivals, {counted_m}, {counted_n}, counted_rows, counted_cols, M, N)",
        f"    {written_m}, {written_n} = -1, -1",
        "    if row0 < M and col0 < N:  # a cluster may own a tile past M or N: it writes no partials",
        f"        {written_m}, {written_n} = tile_m, tile_n"]
    ctx.finish_end = [
        "# reductions: where the tile counted in at this tile's start was the last, fold its row (column)",
        "epilogue_barrier.arrive_and_wait()",
        f"if {flag} != 0:",
        f"    self.finish({flag}, {counted_m}, {counted_n}, ctidx, {partials})"]
    ctx.finish_tail = [
        "# reductions: count in the last tile, and where it is the last of its row (column), fold",
        "epilogue_barrier.arrive_and_wait()  # its partials are all written",
        "if ctidx == COUNTING_THREAD:",
        f"    {flag} = 0",
        f"    if {written_m} >= 0:",
        f"        rows, cols = self.count_in(arrivals, {written_m}, {written_n}, M)",
        f"        {flag} = self.last_of(arrivals, {written_m}, {written_n}, rows, cols, M, N)",
        "epilogue_barrier.arrive_and_wait()",
        f"if {flag} != 0:",
        f"    self.finish({flag}, {written_m}, {written_n}, ctidx, {partials})"]


# ----------------------------------------------------------------------------- checks
def _check_supported(program: Program, config: KernelConfig) -> None:
    if program.a_transform is not None:
        # a 16-byte vector of A in smem holds one token's values: A's contiguous dimension is the classes'
        wanted = program.a_major
        if config.majors[0] != wanted:
            token = "row of A" if program.tokens_along == "row" else "index of K"
            raise UnsupportedError(
                f"program {program.name!r} transforms A with a token per {token}; A must be {wanted.upper()}-major "
                f"(majors '{wanted}?', got {config.majors!r}): its classes contiguous, e.g. "
                + ("the logits (tokens, classes) as stored" if wanted == "k" else "the logits' transpose, logits.t()"))
    for out in program.reductions:
        if out.axis == "col" and out.node.width != ONE:
            raise UnsupportedError(
                f"output {out.name!r}: column reductions of {width_str(out.node.width)}-wide values are not "
                f"lowered to {config.arch} yet (N-wide values are)"
            )
        if out.axis == "col" and out.reduce == "logsumexp":
            raise UnsupportedError(f"output {out.name!r}: column logsumexp is not lowered to {config.arch} yet (row logsumexp is)")
    in_segments = tables_in_segment_reductions(program) if config.stage_tables else set()
    if in_segments:
        raise UnsupportedError(f"tables {sorted(in_segments)}: a segment reduction runs over its segments before "
                               "their subtiles, so it cannot read a table staged in smem (stage_tables)")
    for node in program.nodes:
        if node.op != "segreduce":
            continue
        seg, width = node.attrs[1], node.args[0].width
        acc_cols = seg / width
        if acc_cols.denominator != 1 or acc_cols % 8 or (config.tile[1] * width) % seg:
            raise UnsupportedError(
                f"{node.describe()}: a segment of {seg} columns ({width_str(width)} wide) must span a multiple of 8 "
                f"accumulator columns and divide the tile's {config.tile[1] * width} columns"
            )
        for inner in _subgraph(node.args[0]):
            if inner.op == "segreduce" or (inner.op == "load" and program.operand(inner.attrs[0]).staging == "ring"):
                raise UnsupportedError(
                    f"{node.describe()}: a segment reduction runs over its segments before their subtiles stream "
                    f"through smem, so it cannot read {inner.describe()} (a tile operand or another segment reduction)"
                )


def tables_in_segment_reductions(program: Program) -> set[str]:
    """Table operands (gathered) some segment reduction reads: those are never staged in smem (a
    segment reduction runs over its segments before their subtiles' slices arrive)."""
    return {inner.attrs[0] for node in program.nodes if node.op == "segreduce" for inner in _subgraph(node.args[0])
            if inner.op == "load" and program.operand(inner.attrs[0]).staging == "gather"}


def _staging(op, config: KernelConfig) -> str:
    """How the kernel brings operand ``op``'s values to the epilogue (``primitives.STAGINGS``):
    its kind's staging, except that gathered operands (tables) come through a ring like tiles
    when ``config.stage_tables`` stages them in smem."""
    return "ring" if op.staging == "gather" and config.stage_tables else op.staging


def _subgraph(root: Node) -> list[Node]:
    from .program import _walk

    return _walk([root])


def _class_name(name: str) -> str:
    return "".join(part[:1].upper() + part[1:] for part in name.split("_") if part) + "Kernel"


# ----------------------------------------------------------------------------- tensors and smem
def _declare_tensors(ctx: Context, program: Program, config: KernelConfig) -> None:
    tile_m, tile_n = backend(config.arch).cta_tile(config.tile)
    read = {node.attrs[0] for node in program.nodes if node.op == "load"}  # by the epilogue
    transform_reads = A_TRANSFORMS[program.a_transform].operands if program.a_transform else ()
    for arg in host_arguments(program, config)[2:]:  # after a and b
        unread = ("" if arg.role not in ("operand", "scalar") or arg.of in read or arg.of in transform_reads
                  else " (not read by the program)")
        annotation = "cutlass.Float32" if arg.role == "scalar" else "cute.Tensor"
        ctx.host_params.append(dict(name=arg.name, annotation=annotation, doc=arg.doc() + unread))
    for out in program.tile_outputs:
        dtype = storage(out.dtype, config)
        cols = int(ctx.epi_n * out.node.width)
        ctx.tile_outputs.append(dict(
            label=f"{out.name} ({width_str(out.node.width)} wide, {dtype})", width=out.node.width,
            gmem=f"out_{out.name}", smem=f"smem_out_{out.name}", tma=f"tma_out_{out.name}",
            view=f"view_out_{out.name}", cute_dtype=f"cutlass.{CUTE_DTYPES[dtype]}", dtype=dtype, cols=cols,
            fast=_uses_fragments(out.node.width, dtype), xfer=f"r2s_out_{out.name}", frag=f"frag_out_{out.name}",
            stages="EPI_STAGES",
        ))
    for out in program.reductions:
        lead = "2, " if out.reduce == "logsumexp" else ""
        shape = f"({lead}ceil(N / TILE_N), M)" if out.axis == "row" else f"({lead}ceil(M / TILE_M), N)"
        part, final = f"part_{out.name}", f"out_{out.name}"
        result = "(M,)" if out.axis == "row" else "(N,)"
        # the GEMM kernel writes the partials; it also folds them where the last tile finishes
        # them (finish_in_gemm.py.j2), else the finishing kernel does (finish_kernel.py.j2)
        params = [part, final] if config.finish_in_gemm else [part]
        ctx.kernel_params += params
        ctx.kernel_param_decls += [f"{name}: cute.Tensor" for name in params]
        # the helper that folds the partials over the tiles: sums of squares add as sums do
        fold = dict(helper="finish_" + {"sumsq": "sum"}.get(out.reduce, out.reduce))
        if out.reduce != "logsumexp":
            fold.update(identity=IDENTITY[out.reduce], fold=combine(out.reduce, "total", "%s"))
        # an empty row's log-sum-exp; the finishing kernel also masks the tiles past the last
        if out.reduce == "logsumexp" or not config.finish_in_gemm:
            ctx.helpers.add("where")
        ctx.finishes.append(dict(name=out.name, kind=out.reduce, axis=out.axis, part=part, out=final, shape=shape,
                                 **fold, label=f"{out.axis}_{out.reduce}({out.node.describe()})", result=result,
                                 length="mA.shape[0]" if out.axis == "row" else "mB.shape[0]"))
        if out.axis == "col":
            ctx.col_reductions.append(out.name)
    if program.reductions and config.finish_in_gemm:
        ctx.kernel_params.append("arrivals")
        ctx.kernel_param_decls.append("arrivals: cute.Tensor")
    if transform_reads:
        # the template keeps each of this thread's tokens' values in a register array a_<operand>
        transform = A_TRANSFORMS[program.a_transform]
        values = {name: f"a_{name}[token]" for name in transform_reads}
        ctx.a_transform = dict(name=program.a_transform, tokens=program.tokens_along,
                               operands=[dict(name=name, gmem=f"in_{name}", reg=f"a_{name}", index=name == transform.classes,
                                              log2=name in transform.log2) for name in transform_reads],
                               math=transform.cute.format(a="a_value", cls="a_class", **values))
    for op in program.operands:
        name = f"in_{op.name}"
        in_epilogue = op.name in read
        staging = _staging(op, config)
        if staging == "argument":
            if in_epilogue:
                ctx.kernel_params.append(name)
                ctx.kernel_param_decls.append(f"{name}: cutlass.Float32")
            continue
        dtype = operand_dtype(config, op.name)
        if not in_epilogue and op.name not in transform_reads:  # taken, never loaded
            continue
        if staging == "ring":
            staged = op.staging == "gather"  # a table staged in smem (stage_tables)
            cols = int(ctx.epi_n * op.width)
            if staged:
                period = dict(config.table_periods).get(op.name)
                if period is None:
                    raise UnsupportedError(f"table {op.name!r}: staging it in smem (stage_tables) needs its period "
                                           f"baked in (table_periods, --table-period {op.name}=P)")
                if period % cols:
                    raise UnsupportedError(f"table {op.name!r}: staging it in smem (stage_tables) moves {cols}-column "
                                           f"slices, which must divide its period P = {period}")
            ctx.tile_inputs.append(dict(
                label=f"{op.name} ({width_str(op.width)} wide, {dtype}{', a table' if staged else ''})",
                width=op.width, gmem=name, table=staged,
                smem=f"smem_in_{op.name}", tma=f"tma_in_{op.name}", view=f"view_in_{op.name}",
                cute_dtype=f"cutlass.{CUTE_DTYPES[dtype]}", dtype=dtype, cols=cols,
                fast=_uses_fragments(op.width, dtype), xfer=f"s2r_in_{op.name}", frag=f"frag_in_{op.name}",
                stages="IN_STAGES",
            ))
            continue
        ctx.kernel_params.append(name)
        ctx.kernel_param_decls.append(f"{name}: cute.Tensor")
        if staging == "vector" and in_epilogue:  # the A transform reads its own values from global memory
            is_row = op.width is None  # one value per row, else one per column of its width
            elems = tile_m if is_row else int(tile_n * op.width)
            base = "row0" if is_row else {HALF: "col0 // 2", ONE: "col0", TWO: "2 * col0"}[op.width]
            length = "M" if is_row else {HALF: "N // 2", ONE: "N", TWO: "2 * N"}[op.width]
            threads = backend(config.arch).tile_threads(config)
            index = dtype == "i32"  # class indices stay integers in smem (compared exactly)
            ctx.vectors.append(dict(
                name=op.name, gmem=name, smem=f"smem_in_{op.name}", view=f"view_in_{op.name}", is_row=is_row,
                width=op.width, elems=elems, base=base, length=length, loads_per_thread=-(-elems // threads),
                cute_dtype="cutlass.Int32" if index else "cutlass.Float32", zero="0" if index else "0.0",
            ))
    ctx.epi_load_bytes = sum(tile_m * t["cols"] * DTYPE_BYTES[t["dtype"]] for t in ctx.tile_inputs)
    if ctx.col_reductions:
        ctx.col_scratch_elems = len(ctx.col_reductions) * (backend(config.arch).tile_threads(config) // 32) * ctx.epi_n
    # the widths the template writes, in the kernel's constants: a subtile's columns, a tile's
    for t in ctx.tile_outputs + ctx.tile_inputs:
        t["cols_expr"], t["tile_cols"] = _scaled("EPI_N", t["width"]), _scaled("TILE_N", t["width"])
    for v in ctx.vectors:
        v["elems_expr"] = "TILE_M" if v["is_row"] else _scaled("TILE_N", v["width"])
    # views through accumulator coordinates (see acc_view_of_stage / acc_view_of_vector): a
    # ring's view is of the subtile's stage, made in the subtile loop (per_subtile), so that the
    # pair loop indexes it at static places (ring_lanes); a vector's is made once
    for t in ctx.tile_outputs + ctx.tile_inputs:
        if t["fast"]:
            continue  # N-wide tiles go through stmatrix / ldmatrix fragments instead
        stage = f"subtile % {t['stages']}"
        if _uses_words(t["width"], t["dtype"]):  # 2N wide, 16-bit: one 64-bit word per column pair
            words = _scaled("EPI_N", t["width"] / 4)
            ctx.views.append(dict(name=t["view"], per_subtile=True,
                                  expr=f"acc_view_of_stage(ring_as_words({t['smem']}, {t['smem']}__layout), "
                                       f"{stage}, {words}, 0)"))
            continue
        for lane in _view_lanes(t["width"]):
            ctx.views.append(dict(name=t["view"] + lane, per_subtile=True,
                                  expr=f"acc_view_of_stage({t['smem']}, {stage}, {t['cols_expr']}, {lane.lstrip('_') or 0})"))
    for v in ctx.vectors:
        for lane in ([""] if v["is_row"] else _view_lanes(v["width"])):
            ctx.views.append(dict(name=v["view"] + lane, per_subtile=False,
                                  expr=f"acc_view_of_vector({v['smem']}, {v['is_row']}, {v['elems_expr']}, {lane.lstrip('_') or 0})"))


def _scaled(base: str, factor: Fraction) -> str:
    """``base`` (a constant of the kernel, a multiple of 8) times ``factor``, as the kernel writes it."""
    if factor == 1:
        return base
    return f"{base} // {factor.denominator}" if factor < 1 else f"{factor.numerator} * {base}"


def _times(count: int, expr: str) -> str:
    """``count`` times ``expr``, without a factor of 1."""
    return expr if count == 1 else f"{count} * {expr}"


def _uses_fragments(width: Fraction, dtype: str) -> bool:
    """N-wide 16-bit tiles move through stmatrix / ldmatrix fragments; the rest through smem views."""
    return width == ONE and DTYPE_BYTES[dtype] == 2


def _uses_words(width: Fraction, dtype: str) -> bool:
    """2N-wide 16-bit tiles move through smem as 64-bit words: the four adjacent columns
    2c .. 2c + 3 that accumulator columns c and c + 1 own (one LDS.64 / STS.64 per column pair
    instead of four 16-bit accesses)."""
    return width == TWO and DTYPE_BYTES[dtype] == 2


def _view_lanes(width: Fraction) -> list[str]:
    """Suffixes of the views one operand needs: 2N-wide values need one view per column of a pair."""
    return ["__0", "__1"] if width == TWO else [""]


def fits_shared_memory(program: Program, config: KernelConfig) -> bool:
    """Whether the epilogue rings and mainloop stages ``config`` asks for fit the SM's shared memory."""
    try:
        _plan_smem(program, config)
    except UnsupportedError:
        return False
    return True


def _plan_smem(program: Program, config: KernelConfig) -> tuple[Context, int, int, int]:
    """(context, EPI_STAGES, IN_STAGES, AB_STAGES): the backend's plan of the SM's shared memory."""
    def declare(epi_n: int) -> Context:
        ctx = Context(program=program, config=config, cfg={}, class_name=_class_name(program.name), epi_n=epi_n)
        _declare_tensors(ctx, program, config)
        return ctx

    return backend(config.arch).plan_smem(program, config, declare)


# ----------------------------------------------------------------------------- the per-pair body
class _Body:
    def __init__(self, ctx: Context, program: Program, config: KernelConfig, lines: list | None = None):
        self.ctx, self.program, self.config = ctx, program, config
        self.backend = backend(config.arch)
        self.lanes: dict[int, list[str]] = {}
        self.taken: set[str] = set()
        self.lines = ctx.body if lines is None else lines

    def name(self, base: str) -> str:
        base = f"v_{base}"
        name, i = base, 1
        while name in self.taken:
            i += 1
            name = f"{base}{i}"
        self.taken.add(name)
        return name

    def emit_all(self) -> None:
        for node in self.program.nodes:
            self.emit(node)
        for out in self.program.tile_outputs:
            self.store(out)
        for out in self.program.reductions:
            (self.row_reduction if out.axis == "row" else self.col_reduction)(out)
        self.add_coordinates()

    def add_coordinates(self) -> None:
        """Prepend the element's global coordinates, only where the body reads them."""
        self.lines[:0] = self.backend.coordinates(_refers_to(self.lines, "row"), _refers_to(self.lines, "col"))

    # -- values
    def emit(self, node: Node) -> None:
        lanes = self.values(node)
        count = NUM_LANES[node.width]
        read_once = node.op == "acc" and self._reads(node) > 1  # one register-tensor read, not one per use
        if node.op == "const" or (node.op in ("acc", "pair", "interleave") and not node.hint and not read_once):
            self.lanes[id(node)] = lanes  # literals and lane renames need no code
            return
        if node.op == "load" and self._read_as_index_only(node):
            self.lanes[id(node)] = lanes  # its comparisons read the int32 values themselves
            return
        if node.op == "cast" and self._stored_only_as_cast(node):
            self.lanes[id(node)] = self.lanes[id(node.args[0])]  # the store rounds the same way, once
            return
        base = node.hint or ("acc" if node.op == "acc" else node.attrs[0] if node.op == "load"
                             else f"{node.op.rstrip('_')}{len(self.taken)}")
        names = [self.name(base if count == 1 else f"{base}_{k}") for k in range(count)]
        comment = f"# {node.hint} = {node.expand()}" if node.hint else f"# {node.expand()}"
        self.lines.append(comment)
        word = self._word_load(node)
        if word is not None:  # four 16-bit values from one 64-bit smem word
            self.ctx.helpers.add("unpack_quad")
            self.lines.append(f"{', '.join(names)} = {word}")
            self.lanes[id(node)] = names
            return
        source = self.lanes[id(node.args[0])] if node.op == "cast" else None
        if source is not None and count > 1 and lanes != source:
            # a rounding cast: lanes in pairs through one packed conversion
            self.ctx.helpers.add("round_pair")
            target = CUTE_DTYPES[storage(node.attrs[0], self.config)]
            for k in range(0, count, 2):
                self.lines.append(f"{names[k]}, {names[k + 1]} = round_pair({source[k]}, {source[k + 1]}, cutlass.{target})")
        else:
            for name, code in zip(names, lanes):
                self.lines.append(f"{name} = {code}")
        self.lanes[id(node)] = names

    def _word_load(self, node: Node) -> str | None:
        """The unpacking read of a 2N-wide 16-bit tile operand (see _uses_words), else None."""
        if node.op != "load":
            return None
        op = self.program.operand(node.attrs[0])
        dtype = operand_dtype(self.config, op.name)
        if op.staging != "ring" or not _uses_words(op.width, dtype):
            return None
        return f"unpack_quad(view_in_{op.name}[{self.backend.ring_lanes[0]}], cutlass.{CUTE_DTYPES[dtype]})"

    def _read_as_index_only(self, node: Node) -> bool:
        """Whether every read of this operand value is an integer comparison (`acc.col == target`)."""
        readers = [other for other in self.program.nodes if node in other.args]
        return (bool(readers) and all(self._index_operand(other, node) for other in readers)
                and not any(out.node is node for out in self.program.outputs))

    def _stored_only_as_cast(self, node: Node) -> bool:
        """Whether a cast's value is only stored, in outputs of the dtype it rounds to: rounding
        twice to one dtype is rounding once, so the store's own conversion is the cast (derived
        backwards end in `.to(in)` before their store)."""
        target = storage(node.attrs[0], self.config)
        stores = [out for out in self.program.outputs if out.node is node]
        return (bool(stores) and not any(node in other.args for other in self.program.nodes)
                and all(out.reduce is None and storage(out.dtype, self.config) == target for out in stores))

    def _reads(self, node: Node) -> int:
        """How many times the body reads ``node``'s lanes: as an argument, or as a stored output."""
        args = sum(arg is node for other in self.program.nodes for arg in other.args)
        return args + sum(out.node is node for out in self.program.outputs)

    def values(self, node: Node) -> list[str]:
        op, args = node.op, [self.lanes[id(a)] for a in node.args]
        if op == "acc":
            return list(self.backend.acc_lanes)
        if op == "const":
            return [_literal(node.attrs[0])]
        if op == "row":
            return ["row"]
        if op == "col":
            return {HALF: ["col // 2"], ONE: ["col", "col + 1"],
                    TWO: ["2 * col", "2 * col + 1", "2 * col + 2", "2 * col + 3"]}[node.width]
        if op == "load":
            return self.load(node)
        if op == "cast":
            target = CUTE_DTYPES[storage(node.attrs[0], self.config)]
            return [x if target == "Float32" else f"cutlass.Float32(cutlass.{target}({x}))" for x in args[0]]
        if op == "pair":
            x, k = args[0], node.attrs[0]
            return [x[k]] if len(x) == 2 else [x[k], x[2 + k]]
        if op == "interleave":
            a, b = (_broadcast(x, NUM_LANES[node.width] // 2) for x in args)
            return [lane for pair in zip(a, b) for lane in pair]
        if op == "segreduce":
            return [self.segment_reduction(node)] * NUM_LANES[node.width]
        return self.elementwise(node, args)

    def segment_reduction(self, node: Node) -> str:
        """Reduce over each column segment of a row before the pairs that read it (the backend's
        pass: the whole tile before the subtiles, or each segment at its first subtile); return
        the lookup."""
        kind, seg = node.attrs
        width = node.args[0].width
        reg = f"seg{len(self.ctx.segments)}"
        acc_cols = int(seg / width)  # accumulator columns per segment
        inner = _Body(self.ctx, self.program, self.config, lines=[])
        for sub in _subgraph(node.args[0]):
            inner.emit(sub)
        inner.add_coordinates()
        lanes = inner.lanes[id(node.args[0])]
        b = self.backend
        registers, index = b.segment_registers(acc_cols, self.config.tile[1])
        slot = f"{reg}[{index}]"
        ctx = self.ctx
        ctx.segments.append(reg)
        if kind == "logsumexp":
            ctx.helpers.update({"where", "logsumexp"})
            init = [(f"{reg}_max = cute.make_rmem_tensor(({registers},), cutlass.Float32)",
                     f"{reg}_max.fill(-float(\"inf\"))"),
                    (f"{reg} = cute.make_rmem_tensor(({registers},), cutlass.Float32)", f"{reg}.fill(0.0)")]
            update = [f"{slot.replace(reg, reg + '_max')}, {slot} = logsumexp_update("
                      f"{slot.replace(reg, reg + '_max')}, {slot}, {lane})" for lane in lanes]
        else:
            init = [(f"{reg} = cute.make_rmem_tensor(({registers},), cutlass.Float32)", f"{reg}.fill({IDENTITY[kind]})")]
            update = [f"{slot} = {combine(kind, slot, reduce_term(kind, lane))}" for lane in lanes]
        lines = b.segment_pass(acc_cols, inner.lines + update)
        if kind == "logsumexp":
            fold = b.row_fold([f"other_top = {b.row_shuffle('top')}", f"other_total = {b.row_shuffle('total')}",
                               "top, total = logsumexp_merge(top, total, other_top, other_total)"])
            finish = [f"top, total = {reg}_max[k], {reg}[k]", *fold, f"{reg}[k] = top + cute.math.log(total, fastmath=True)"]
        else:
            fold = b.row_fold([f"total = {combine(kind, 'total', b.row_shuffle('total'))}"])
            finish = [f"total = {reg}[k]", *fold, f"{reg}[k] = total"] if fold else []  # else a thread holds the rows
        if finish:
            lines += [f"for k in cutlass.range_constexpr({registers}):  # {b.row_sharing}", *("    " + line for line in finish)]
        tile, subtile = b.segment_scope(acc_cols, f"{node.describe()}: per row and {seg}-column segment", init, lines)
        ctx.tile_prologue += tile
        ctx.subtile_segments += subtile
        return slot

    def elementwise(self, node: Node, args: list[list[str]]) -> list[str]:
        op = ELEMENTWISE[node.op]
        if node.dtype == "i32" and op.cute_int:
            code = op.cute_int
        else:
            code = op.cute
            self.ctx.helpers.update(op.helpers)
        # an int32 operand compared with a coordinate is read as an integer (program.reads_as_index)
        dtypes = ["i32" if self._index_operand(node, a) else a.dtype for a in node.args]
        args = [self.load(a, as_index=True) if self._index_operand(node, a) else lanes for a, lanes in zip(node.args, args)]
        floating = node.dtype == "f32" or "f32" in dtypes
        kind = "cutlass.Int32" if node.dtype == "i32" else "cutlass.Float32"
        out = []
        for k in range(NUM_LANES[node.width]):
            lane_args = []
            for dtype, lanes in zip(dtypes, args):
                value = lanes[k] if len(lanes) > 1 else lanes[0]
                if floating and dtype == "i32":
                    value = f"cutlass.Float32({value})"  # CuTe math needs one numeric type
                lane_args.append(value)
            out.append(code.format(*lane_args, t=kind))
        return out

    def _index_operand(self, node: Node, arg: Node) -> bool:
        """Whether ``node`` reads ``arg``, the value of an int32 operand, as an integer index."""
        return reads_as_index(node, arg) and operand_dtype(self.config, arg.attrs[0]) == "i32"

    def load(self, node: Node, as_index: bool = False) -> list[str]:
        op = self.program.operand(node.attrs[0])
        name, staging = f"in_{op.name}", _staging(op, self.config)
        if staging == "argument":
            return [name]
        if staging == "gather":
            cols = self.values(Node("col", (), (), "i32", op.width))
            if self.lines is not self.ctx.body:  # a segment reduction's pass: load in place
                return [_table_read(name, c) for c in cols]
            table = next((t for t in self.ctx.tables if t["gmem"] == name), None)
            if table is None:
                table = dict(gmem=name, frag=f"frag_table_{op.name}", cols=cols)
                self.ctx.tables.append(table)
            return [self.backend.table_value(table["frag"], _table_slot(len(cols), k)) for k in range(len(cols))]
        view = f"view_in_{op.name}"
        index = operand_dtype(self.config, op.name) == "i32"  # an int32 vector's values, as fp32 unless as_index
        wrap = "cutlass.Float32({})" if staging == "ring" or (index and not as_index) else "{}"
        # a ring's view is of the subtile's stage (ring_lanes), a vector's of the tile
        pair = self.backend.ring_lanes if staging == "ring" else ("pair0", "pair1")
        if op.width in (None, HALF):  # a row vector, or one value per column pair
            return [wrap.format(f"{view}[{pair[0]}]")]
        if staging == "ring" and _uses_fragments(op.width, operand_dtype(self.config, op.name)):
            return [f"cutlass.Float32(frag_in_{op.name}[slot{e}])" for e in (0, 1)]
        if op.width == ONE:
            return [wrap.format(f"{view}[{pair[e]}]") for e in (0, 1)]
        return [wrap.format(f"{view}__{q}[{pair[e]}]") for e in (0, 1) for q in (0, 1)]

    # -- outputs
    def store(self, out) -> None:
        lanes = _broadcast(self.lanes[id(out.node)], NUM_LANES[out.node.width])
        stored = storage(out.dtype, self.config)
        dtype = CUTE_DTYPES[stored]
        view = f"view_out_{out.name}"
        self.lines.append(f"# store {out.name}")
        pair = self.backend.ring_lanes  # outputs are rings: the view of the subtile's stage
        if _uses_words(out.node.width, stored):  # one 64-bit word
            self.ctx.helpers.add("pack_quad")
            self.lines.append(f"{view}[{pair[0]}] = pack_quad({', '.join(lanes)}, cutlass.{dtype})")
            return
        fast = _uses_fragments(out.node.width, stored)
        targets = {HALF: [f"{view}[{pair[0]}]"],
                   ONE: [f"frag_out_{out.name}[slot{e}]" if fast else f"{view}[{pair[e]}]" for e in (0, 1)],
                   TWO: [f"{view}__{q}[{pair[e]}]" for e in (0, 1) for q in (0, 1)]}[out.node.width]
        for target, value in zip(targets, lanes):
            self.lines.append(f"{target} = cutlass.{dtype}({value})")

    def _valid_cols(self, width: Fraction) -> list[str]:
        """Per lane: is the lane's accumulator column inside N (reductions skip padding)."""
        return {HALF: ["col < N"], ONE: ["col < N", "col + 1 < N"],
                TWO: ["col < N", "col < N", "col + 1 < N", "col + 1 < N"]}[width]

    def row_reduction(self, out) -> None:
        ctx, reg, kind = self.ctx, f"red_{out.name}", out.reduce
        slot, registers = self.backend.row_register, self.backend.row_registers  # this thread's rows
        lanes = self.lanes[id(out.node)]
        valid = self._valid_cols(out.node.width)
        self.lines.append(f"# {out.name}: per-row {kind} of {out.node.describe()}, this thread's share")
        if kind == "logsumexp":
            ctx.helpers.update(("where", "logsumexp"))
            ctx.tile_prologue += [f"{reg}__max = cute.make_rmem_tensor(({registers},), cutlass.Float32)",
                                  f"{reg}__max.fill(-float(\"inf\"))",
                                  f"{reg}__sum = cute.make_rmem_tensor(({registers},), cutlass.Float32)",
                                  f"{reg}__sum.fill(0.0)"]
            # the running pair is read and written once per column pair, folding in each lane
            self.lines += [f"run_max = {reg}__max[{slot}]", f"run_sum = {reg}__sum[{slot}]"]
            for lane, ok in zip(lanes, valid):
                self.lines.append(f"run_max, run_sum = logsumexp_update(run_max, run_sum, "
                                  f"where({ok}, {lane}, -float(\"inf\")))")
            self.lines += [f"{reg}__max[{slot}] = run_max", f"{reg}__sum[{slot}] = run_sum"]
            ctx.tile_epilogue += self.backend.row_partials(
                out.name, "(max, sum of exp)",
                read=[f"row_max = {reg}__max[{slot}]", f"row_sum = {reg}__sum[{slot}]"],
                fold=[f"other_max = {self.backend.row_shuffle('row_max')}",
                      f"other_sum = {self.backend.row_shuffle('row_sum')}",
                      "row_max, row_sum = logsumexp_merge(row_max, row_sum, other_max, other_sum)"],
                write=[f"part_{out.name}[(0, tile_n, row)] = row_max", f"part_{out.name}[(1, tile_n, row)] = row_sum"])
            return
        identity = IDENTITY[kind]
        ctx.tile_prologue += [f"{reg} = cute.make_rmem_tensor(({registers},), cutlass.Float32)", f"{reg}.fill({identity})"]
        total = f"{reg}[{slot}]"  # read and written once per column pair
        # padding columns past N are masked, except where the value there is exactly 0, the identity
        masked = kind not in ("sum", "sumsq", "maxabs") or not _zero_past_n(self.program, out.node)
        if masked:
            ctx.helpers.add("where")
        for lane, ok in zip(lanes, valid):
            term = reduce_term(kind, lane)
            total = combine(kind, total, f"where({ok}, {term}, {identity})" if masked else term)
        self.lines.append(f"{reg}[{slot}] = {total}")
        ctx.tile_epilogue += self.backend.row_partials(
            out.name, "partial", read=[f"total = {reg}[{slot}]"],
            fold=[f"total = {combine(kind, 'total', self.backend.row_shuffle('total'))}"],
            write=[f"part_{out.name}[(tile_n, row)] = total"])

    def col_reduction(self, out) -> None:
        ctx, reg, kind = self.ctx, f"red_{out.name}", out.reduce
        slot = ctx.col_reductions.index(out.name)
        identity = IDENTITY[kind]
        lanes = self.lanes[id(out.node)]
        offset = _times(slot, "(TILE_THREADS // 32) * EPI_N") if slot else ""  # where its scratch starts
        ctx.helpers.add("where")
        b = self.backend
        ctx.subtile_prologue += [f"{reg} = cute.make_rmem_tensor(({b.column_registers},), cutlass.Float32)",
                                 f"{reg}.fill({identity})"]
        self.lines.append(f"# {out.name}: per-column {kind} of {out.node.describe()}, this thread's rows")
        for e, lane in enumerate(lanes):
            term = reduce_term(kind, lane)
            slot_expr = b.column_slot(reg, e)
            self.lines.append(f"{slot_expr} = {combine(kind, slot_expr, f'where(row < M, {term}, {identity})')}")
        ctx.subtile_compute_end += [f"# {out.name}: combine {b.column_sharing},",
                                    "# then park each warp's column sums in smem (col_scratch)",
                                    *self.backend.column_exchange(kind, reg, ctx.epi_n, offset)]
        gather = combine(kind, "total", f"col_scratch[{offset + ' + ' if offset else ''}warp * EPI_N + ctidx]")
        ctx.subtile_epilogue += [
            f"# {out.name}: combine the warps, write this tile's partial for the subtile's columns",
            "if ctidx < EPI_N:",
            f"    total = {identity}",
            "    for warp in cutlass.range_constexpr(TILE_THREADS // 32):",
            f"        total = {gather}",
            "    global_col = col0 + subtile * EPI_N + ctidx",
            "    if global_col < N and row0 < M:  # a cluster may own a tile past M: no partial",
            f"        part_{out.name}[(tile_m, global_col)] = total",
        ]


def _refers_to(lines: list[str], name: str) -> bool:
    """Whether generated code lines refer to `name`, their comments aside ("per-row sum")."""
    return any(re.search(rf"\b{name}\b", line.split("#", 1)[0]) for line in lines)


def _zero_past_n(program: Program, node: Node) -> bool:
    """Whether `node` is exactly 0 in a ragged tile's padding columns past N, so that a row sum
    needs no `col < N` mask there.  TMA fills B's rows past N with zeros, so the accumulator is 0
    there; N-wide tile inputs are loaded by TMA too; column vectors are loaded as 0 past N (a
    table's columns wrap, even staged in smem); ops that keep zeros keep it.  (An inf or NaN in
    a row of A makes that row's padding NaN, where its valid values are all inf or NaN already.)
    Column sums keep their `row < M` mask: without it rmsnorm_bwd's dgamma spilled registers."""
    if node.op == "acc":
        return True
    if node.op == "const":
        return node.attrs[0] == 0
    if node.op == "load":
        operand = program.operand(node.attrs[0])
        return operand.staging in ("ring", "vector") and operand.width == ONE
    if node.op == "cast" or (node.op in ELEMENTWISE and ELEMENTWISE[node.op].keeps_zero):
        return all(_zero_past_n(program, arg) for arg in node.args)
    return False


def _broadcast(lanes: list[str], count: int) -> list[str]:
    return lanes if len(lanes) == count else lanes * count


def _literal(value) -> str:
    if isinstance(value, float) and math.isinf(value):
        return 'float("inf")' if value > 0 else '-float("inf")'
    return repr(value)

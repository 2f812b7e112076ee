"""The ``coda-cute`` command: browse the library, emit and inspect kernels, manage the cache.

    coda-cute list [--names]                  library programs, one line each
    coda-cute show PROGRAM [--backward]       a program's operands, values and outputs
    coda-cute emit PROGRAM [--backward] [config] [-o FILE] [--compile]
                                              the CuTe-DSL source of one kernel
    coda-cute inspect PROGRAM [--backward] [config] [--source] [--ptx] [--sass] [--regs]
                                              compile for the arch (no GPU needed) and show
                                              the source, PTX, SASS or ptxas' register report
    coda-cute cache ls | clear | path         the disk cache of compiled kernels
    coda-cute precompile PROGRAM... | --all [config...] [--jobs N]
                                              fill the disk cache ahead of time
    coda-cute tune PROGRAM --shape MxNxK [--backward] [--dtype bf16]
                                              on this machine's GPU: time the candidate tiles
                                              at that shape and keep the fastest for later calls

PROGRAM is a library name (``coda-cute list``), ``path/to/file.py:name`` or
``package.module:name`` (a program defined at the top level of that file or module);
``--backward`` takes the program derived from it (``coda_cute.derive``).

Config flags (the ones every emitted kernel's header prints, so that line regenerates it):
``--arch sm_90a --gpu H200 --dtype bf16 --majors kk --tile 128x256 --cluster 2x1
--schedule cooperative --operand-dtype NAME=DTYPE``.

Without ``--tile``, ``--cluster`` and ``--schedule`` the commands build what a call on a large
problem runs: the runtime's rules' choice, or, where its kernel spills registers, the fallback a
call decided on (``cache.get_default_kernel``).  ``emit`` and ``inspect`` use a decision already in
the cache (they compile nothing to make one; ``inspect`` says when the kernel it shows spills
undecided); ``precompile`` makes it, compiling the fallbacks where the rules' choice spills, and
records it, so later calls go straight to the kernel they run.

Errors the user can fix (``coda_cute.errors.CodaError``) print as one line,
``coda-cute: error: <message>``, and exit with status 2.

``coda_cute.precompile.precompile(programs, configs, jobs=...)`` is the Python API behind
``coda-cute precompile``; ``Kernel(program, autotune=True)`` the one behind ``coda-cute tune``
(a call with ``autotune=True`` at that shape then starts with the winner).
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import sys
import tempfile
import time
from pathlib import Path

from .config import CLUSTER_SHAPES, DEFAULT_GPUS, DEFAULT_SWIZZLE, GPUS, SCHEDULES, SWIZZLES, TILE_SHAPES
from .config import KernelConfig, unrolled_subtiles
from .config import parse_operand_dtypes, parse_pair
from .errors import CodaError, ProgramError, UnsupportedError
from .program import Program, width_str
from .runtime import runtime_defaults
from .spelling import CUTE_DTYPES
from .version import __version__

PROG = "coda-cute"
PROGRAM_HELP = "a library program (see `coda-cute list`), path/to/file.py:name or package.module:name"


# ----------------------------------------------------------------------------- config flags
def _pair(text: str, what: str, allowed: tuple[tuple[int, int], ...]) -> tuple[int, int]:
    pair = parse_pair(text, what)
    if pair not in allowed:
        choices = ", ".join(f"{a}x{b}" for a, b in allowed)
        raise UnsupportedError(f"{what} {pair[0]}x{pair[1]} is not supported; choose one of {choices}")
    return pair


def parse_tile(text: str) -> tuple[int, int]:
    """'128x256' -> (128, 256), or an error listing the supported tiles."""
    return _pair(text, "tile", TILE_SHAPES)


def parse_cluster(text: str) -> tuple[int, int]:
    """'2x1' -> (2, 1), or an error listing the supported cluster shapes."""
    return _pair(text, "cluster", CLUSTER_SHAPES)


# ----------------------------------------------------------------------------- commands
def _out(text: str = "") -> None:
    print(text, flush=True)


def _note(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _output_summary(program: Program) -> str:
    """'D N/2, sumsq row_sumsq': each output's width (tiles) or reduction (one value per row/column)."""
    parts = []
    for out in program.outputs:
        if out.is_reduction:
            parts.append(f"{out.name} {out.axis}_{out.reduce}")
        else:
            dtype = "" if out.dtype in (None, "in") else f" {out.dtype}"
            parts.append(f"{out.name} {width_str(out.node.width)}{dtype}")
    return ", ".join(parts)


def cmd_list(args) -> int:
    from . import library

    table = library.programs()
    if args.names:
        for name in table:
            _out(name)
        return 0
    from .lower import lower

    rows = []
    for name, program in table.items():
        doc = program.doc.strip().splitlines()[0] if program.doc.strip() else ""
        try:
            lower(program, KernelConfig())
        except UnsupportedError:
            doc = f"[reference interpreter only: not lowered to {KernelConfig().arch}] {doc}"
        rows.append((name, _output_summary(program), doc))
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    _out(f"{'program':<{w0}}  {'outputs':<{w1}}  summary")
    for name, outputs, doc in rows:
        _out(f"{name:<{w0}}  {outputs:<{w1}}  {doc}".rstrip())
    return 0


def _program(args) -> tuple[Program, str]:
    """The program the command line names, and how to name it again (the emitted header's
    command): ``args.name`` resolved (``library.resolve``), or with ``--backward`` its derived
    backward program."""
    from .library import resolve

    program = resolve(args.name)
    if not getattr(args, "backward", False):
        return program, args.name
    from .derive import derive

    return derive(program).backward, f"--backward {args.name}"


def cmd_show(args) -> int:
    program, _ = _program(args)
    if args.backward:
        from .derive import derive

        _out(derive(program.derived_from).describe())
    _out(program.describe())
    return 0


def parse_table_periods(program: Program, items) -> tuple[tuple[str, int], ...]:
    """``NAME=P`` flags -> ``KernelConfig.table_periods``, checked against ``program``'s tables."""
    tables = [op.name for op in program.operands if op.kind == "table"]
    found = {}
    for item in items or ():
        name, _, value = item.partition("=")
        if name not in tables or not value.isdigit() or int(value) <= 0:
            raise UnsupportedError(f"--table-period {item!r}: expected NAME=P with NAME one of the Table operands "
                                   f"{tables or '(none)'} and P a positive integer")
        found[name] = int(value)
    return tuple(found.items())


def _default_path(args) -> bool:
    """Whether the command line fixes none of tile, cluster and schedule (see the module docstring)."""
    return not (args.tile or args.cluster or args.schedule)


def _config(program: Program, args) -> KernelConfig:
    """The kernel the command builds: the flags' (``_flag_config``), or with none of tile, cluster
    and schedule given, the default decided already for it where there is one."""
    config = _flag_config(program, args)
    return _decided(program, args, config) or config


def _decided(program: Program, args, config: KernelConfig) -> KernelConfig | None:
    """The default decided for the flags' ``config`` (``cache.cached_default``), where they leave
    tile, cluster and schedule to the runtime and a call or ``precompile`` has decided it."""
    if not _default_path(args):
        return None
    from .cache import cached_default

    return cached_default(program, config)


def _flag_config(program: Program, args, *, check: bool = True, **one) -> KernelConfig:
    """The kernel the flags describe; what they leave out follows `Kernel`'s rules.  ``one``:
    the values of flags that precompile takes several of, one combination (``precompile_requests``)."""
    args = argparse.Namespace(**{**vars(args), **one})
    tile, cluster, schedule = runtime_defaults(  # an unknown schedule is kept, for check() to name
        program, parse_tile(args.tile) if args.tile else None, parse_cluster(args.cluster) if args.cluster else None,
        args.schedule, arch=args.arch)
    config = KernelConfig(
        arch=args.arch, gpu=args.gpu or DEFAULT_GPUS.get(args.arch, KernelConfig.gpu), dtype=args.dtype,
        majors=args.majors,
        tile=tile, cluster=cluster, schedule=schedule,
        operand_dtypes=parse_operand_dtypes(program, args.operand_dtype),
        table_periods=parse_table_periods(program, getattr(args, "table_period", None)),
        ab_stages=getattr(args, "ab_stages", None) or 0,
        epi_stages=getattr(args, "epi_stages", None) or 0, in_stages=getattr(args, "in_stages", None) or 0,
        raster_along_m=_raster_along_m(getattr(args, "raster", "m")), swizzle=getattr(args, "swizzle", DEFAULT_SWIZZLE),
        stage_tables=bool(getattr(args, "stage_tables", False)),
        finish_in_gemm=bool(getattr(args, "finish_in_gemm", False)),
        unroll_subtiles=_unroll_subtiles(getattr(args, "unroll_subtiles", None), schedule, args.arch),
    )
    return config.check() if check else config


def _unroll_subtiles(asked: bool | None, schedule, arch: str) -> bool:
    """--unroll-subtiles / --no-unroll-subtiles, else the runtime's form for a large problem."""
    return unrolled_subtiles(schedule, arch) if asked is None else asked


def _raster_along_m(raster: str) -> bool:
    if raster not in ("m", "n"):
        raise UnsupportedError(f"raster {raster!r}: expected m (down M first) or n (across N first)")
    return raster == "m"


def cmd_emit(args) -> int:
    from .render import emit

    program, reference = _program(args)
    config = _config(program, args)
    source = emit(program, config, reference=reference)
    if args.output:
        path = Path(args.output)
        try:
            path.write_text(source)
        except OSError as exc:
            raise UnsupportedError(f"cannot write {path}: {exc.strerror or exc}") from None
        _note(f"wrote {path} ({len(source.splitlines())} lines): {program.name}, {config.describe()}")
    else:
        sys.stdout.write(source)
        sys.stdout.flush()
    if args.compile:
        from .compile import compile_source

        with tempfile.TemporaryDirectory(prefix="coda_cute_emit_") as tmp:
            compiled = compile_source(source, program, config, source_dir=Path(tmp))
        _note(f"compiled {program.name} for {config.arch} in {compiled.compile_seconds:.2f} s")
    return 0


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def ptxas_lines(report: str) -> list[str]:
    """The ptxas lines of a compile report, without terminal colors or the DSL's remark prefix."""
    lines = []
    for line in _ANSI.sub("", report).splitlines():
        if "ptxas" in line:
            lines.append(line.split("ptxas output: ", 1)[-1].strip())
    return lines


def cmd_inspect(args) -> int:
    from .compile import compile_source
    from .render import emit

    program, reference = _program(args)
    asked = _flag_config(program, args)
    decided = _decided(program, args, asked)
    config = decided or asked
    source = emit(program, config, reference=reference)
    wanted = [w for w in ("source", "ptx", "sass", "regs") if getattr(args, w)] or ["regs"]
    keep = tuple(w for w in ("ptx", "sass") if w in wanted)
    if args.dump_dir:
        try:
            Path(args.dump_dir).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UnsupportedError(f"--dump-dir {args.dump_dir}: cannot create it ({exc.strerror or exc})") from None
    with tempfile.TemporaryDirectory(prefix="coda_cute_inspect_") as tmp:
        dump = Path(args.dump_dir) if args.dump_dir else Path(tmp) / "dump"
        kept = keep or (("ptx",) if args.dump_dir else ())  # --dump-dir alone still keeps PTX + cubin there
        compiled = compile_source(source, program, config, keep=kept, dump_dir=dump if kept else None,
                                  source_dir=Path(tmp) / "src", report="regs" in wanted)
        _out(f"# {program.name}: {config.describe()}; compiled in {compiled.compile_seconds:.2f} s")
        from .cache import REASONS, SPILL_TOLERATED_ACCESSES, default_candidates, rejection

        reason = rejection(config, compiled)
        if _default_path(args) and not decided and reason:
            fallbacks = ", then ".join(f"{c.schedule} {c.tile[0]}x{c.tile[1]}"
                                       + ("" if c.unroll_subtiles == unrolled_subtiles(c.schedule, c.arch) else
                                          " with the other subtile loop where the one before spills")
                                       for c in default_candidates(config, reason == "latency-bound")[1:])
            detail = (f"{compiled.stack_frame_bytes} bytes of stack frame per thread, "
                      f"{compiled.local_accesses} loads and stores of it in the SASS" if reason == "spills"
                      else f"{compiled.instructions} SASS instructions")
            why = f"{REASONS[reason]} ({detail})"
            _out(f"# {why} and no default is decided for it yet: a call tries {fallbacks} and runs the first "
                 "that neither spills nor runs latency-bound (`coda-cute precompile` decides it ahead of time)")
        elif compiled.stack_frame_bytes and reason != "spills":
            _out(f"# a {compiled.stack_frame_bytes}-byte stack frame with {compiled.local_accesses} loads and stores "
                 f"of it in the SASS: a few values parked about once per tile, which a default may run "
                 f"(at most {SPILL_TOLERATED_ACCESSES}: cache.SPILL_TOLERATED_ACCESSES)")
        if "source" in wanted:
            _out("# ---- source")
            sys.stdout.write(source)
        for kind in keep:
            path = compiled.artifacts[kind]
            shown = path if args.dump_dir else path.name
            _out(f"# ---- {kind.upper()} ({shown})")
            sys.stdout.write(path.read_text())
        if "regs" in wanted:
            _out("# ---- ptxas register report")
            spills = compiled.spill_bytes
            _out(f"registers: {compiled.registers} per thread; "
                 f"spills: {'unknown' if spills is None else f'{spills} bytes'}")
            for line in ptxas_lines(compiled.report):
                _out(f"  {line}")
    sys.stdout.flush()
    return 0


def cmd_cache(args) -> int:
    from . import cache

    root = cache.cache_dir()
    if args.action == "path":
        _out(str(root))
    elif args.action == "clear":
        removed = cache.clear()
        _out(f"removed {removed} kernel{'s' if removed != 1 else ''} from {root}")
    else:
        entries = cache.list_entries()
        if not entries:
            _out(f"no kernels cached in {root}")
            return 0
        _out(f"{len(entries)} kernel{'s' if len(entries) != 1 else ''} in {root}")
        total = 0
        for e in entries:
            total += e.get("bytes", 0)
            seconds = e.get("compile_seconds")
            took = f"{seconds:.2f} s" if isinstance(seconds, (int, float)) else "?"
            _out(f"  {str(e.get('key', '?'))[:12]}  {e.get('program', '?'):<22} {e.get('config', '?')}  "
                 f"[{e.get('bytes', 0) / 1024:.0f} KiB, compiled in {took}, {e.get('created', '?')}]")
        _out(f"total {total / 1024 / 1024:.1f} MiB")
    return 0


def precompile_requests(args) -> list[tuple[Program, KernelConfig]]:
    """The (program, config) pairs a `coda-cute precompile` command line asks for."""
    from . import library

    programs = list(library.programs().values()) if args.all else [library.resolve(n) for n in args.names]
    # Each value on its own must be valid (a typo is an error); combinations that do not go
    # together (a ping-pong schedule with a 128x256 tile) are skipped by precompile_pairs.
    for tile in args.tile or []:
        parse_tile(tile)
    for cluster in args.cluster or []:
        parse_cluster(cluster)
    for schedule in args.schedule or []:
        if schedule not in SCHEDULES:
            raise UnsupportedError(f"schedule {schedule!r}: expected one of {', '.join(SCHEDULES)}")
    KernelConfig(arch=args.arch, gpu=DEFAULT_GPUS.get(args.arch, KernelConfig.gpu)).check()
    gpus = args.gpu or [DEFAULT_GPUS[args.arch]]
    for gpu in gpus:
        KernelConfig(arch=args.arch, gpu=gpu).check()
    for field, values in (("dtype", args.dtype), ("majors", args.majors)):
        for value in values or []:
            KernelConfig(**{field: value}).check()
    if args.all:  # --operand-dtype residual=f32 --all: for the programs that have a `residual`
        for flag, items, kinds in (("--operand-dtype", args.operand_dtype, None), ("--table-period", args.table_period,
                                                                                   ("table",))):
            everywhere = {op.name for p in programs for op in p.operands if op.kind != "scalar"
                          and (kinds is None or op.kind in kinds)}
            for item in items or []:
                if item.partition("=")[0].strip() not in everywhere:
                    raise UnsupportedError(f"{flag} {item}: no library program has a "
                                           f"{'table' if kinds else 'tensor'} operand named "
                                           f"{item.partition('=')[0].strip()!r}")
    pairs = []
    for program in programs:
        items, periods = args.operand_dtype or [], args.table_period or []
        if args.all:
            tensors = {op.name for op in program.operands if op.kind != "scalar"}
            items = [item for item in items if item.partition("=")[0].strip() in tensors]
            tables = {op.name for op in program.operands if op.kind == "table"}
            periods = [item for item in periods if item.partition("=")[0].strip() in tables]
        combinations = itertools.product(gpus, args.dtype or [KernelConfig.dtype], args.majors or [KernelConfig.majors],
                                         args.tile or [None], args.cluster or [None], args.schedule or [None])
        for gpu, dtype, majors, tile, cluster, schedule in combinations:
            pairs.append((program, _flag_config(program, args, check=False, gpu=gpu, dtype=dtype, majors=majors,
                                                tile=tile, cluster=cluster, schedule=schedule, operand_dtype=items,
                                                table_period=periods)))
    return pairs


def cmd_precompile(args) -> int:
    from . import library
    from .cache import cache_dir
    from .precompile import precompile_pairs

    if args.all and args.names:
        raise ProgramError("give program names or --all, not both")
    if not args.all and not args.names:
        raise ProgramError(f"name the programs to precompile, or --all; available: {', '.join(library.programs())}")
    if args.jobs is not None and args.jobs < 1:
        raise UnsupportedError(f"--jobs {args.jobs}: expected at least 1")
    pairs = precompile_requests(args)
    start = time.perf_counter()
    results = precompile_pairs(pairs, jobs=args.jobs, progress=_out, decide=_default_path(args))
    skipped = [r for r in results if r.status == "skipped"]
    failed = [r for r in results if r.status == "failed"]
    built = [r for r in results if r.ok]
    if not built and not failed:
        more = f" (and {len(skipped) - 1} more)" if len(skipped) > 1 else ""
        raise UnsupportedError(f"nothing to precompile: {skipped[0].line()}{more}")
    for r in skipped:
        _note(r.line())
    counts = {s: sum(r.status == s for r in built) for s in ("compiled", "disk", "memory")}
    _out(f"{len(built)} kernel{'s' if len(built) != 1 else ''} in {cache_dir()} "
         f"({counts['compiled']} compiled, {counts['disk'] + counts['memory']} already cached"
         f"{f', {len(skipped)} skipped' if skipped else ''}) in {time.perf_counter() - start:.1f} s")
    if failed:  # not the user's doing: a generator or compiler bug, so status 1, not 2
        _note(f"{PROG}: error: {len(failed)} of {len(failed) + len(built)} kernels failed to compile; "
              f"first: {failed[0].line()}")
        return 1
    return 0


# ----------------------------------------------------------------------------- parser
def parse_shape(text: str) -> tuple[int, int, int]:
    match = re.fullmatch(r"(\d+)x(\d+)x(\d+)", text or "")
    if not match or 0 in (shape := tuple(int(x) for x in match.groups())):
        raise UnsupportedError(f"--shape must be MxNxK with positive sizes (A is M x K, B is N x K), got {text!r}")
    return shape


def cmd_tune(args) -> int:
    import torch

    from .arguments import TORCH_DTYPES, bind, random_call
    from .cache import get_tuned_kernel, short_config
    from .runtime import Kernel, _candidate_timer

    program, name = _program(args)
    m, n, k = parse_shape(args.shape)
    if not torch.cuda.is_available():
        raise UnsupportedError("tune times kernels on this machine's GPU, and it has none (torch.cuda is not "
                               "available); `coda-cute precompile` builds kernels without one")
    a, b, operands = random_call(program, m, n, k, TORCH_DTYPES[args.dtype])
    problem = bind(program, a, b, operands)
    config = Kernel(program, autotune=True).config_for(problem)
    tuned = get_tuned_kernel(program, config, (m, n, k), _candidate_timer(program, problem))
    if not tuned.times:
        _out(f"{name} at {m}x{n}x{k}: decided before, runs {short_config(tuned.config)}")
        return 0
    _out(f"{name} at {m}x{n}x{k}, ms per call (median):")
    for candidate, ms in sorted(tuned.times.items(), key=lambda item: item[1]):
        _out(f"  {ms:9.4f}  {short_config(candidate)}{'  <- runs' if candidate == tuned.config else ''}")
    return 0


def _add_config_flags(parser: argparse.ArgumentParser, several: bool = False) -> None:
    """The flags ``render.emit_command`` prints; with ``several``, most may be repeated."""
    d = KernelConfig()
    group = parser.add_argument_group("kernel configuration" + (" (repeat a flag to build several)" if several else ""))
    many = dict(action="append", default=None) if several else {}

    def default(value: str) -> dict:
        return many if several else dict(default=value)

    group.add_argument("--arch", default=d.arch, help=f"target architecture (default {d.arch})")
    group.add_argument("--gpu", **default(None), metavar="GPU",
                       help=f"GPU model, sets the persistent grid: {', '.join(GPUS)} (default: the arch's, "
                            f"{', '.join(f'{gpu} for {arch}' for arch, gpu in DEFAULT_GPUS.items())})")
    group.add_argument("--dtype", **default(d.dtype), help=f"A and B dtype: bf16 or f16 (default {d.dtype})")
    group.add_argument("--majors", **default(d.majors),
                       help=f"A's major (k or m) then B's (k or n); kk is x @ W.T (default {d.majors})")
    # tile, cluster and schedule default to what the runtime picks for the program (large
    # problems), so `emit` and `inspect` show the kernel a call would run
    picked = "what the runtime picks for the program on large problems"
    group.add_argument("--tile", **many if several else {}, metavar="MxN",
                       help=f"CTA tile: {', '.join(f'{a}x{b}' for a, b in TILE_SHAPES)} (default {picked})")
    group.add_argument("--cluster", **many if several else {}, metavar="MxN",
                       help=f"CTA cluster: {', '.join(f'{a}x{b}' for a, b in CLUSTER_SHAPES)} (default {picked})")
    group.add_argument("--schedule", **many if several else {}, metavar="SCHEDULE",
                       help=f"consumer warpgroups: {', '.join(SCHEDULES)} (ping-pong takes tiles of up to 128x192 "
                            f"elements; default {picked})")
    group.add_argument("--operand-dtype", action="append", metavar="NAME=DTYPE",
                       help=f"dtype of a tensor operand ({', '.join(CUTE_DTYPES)}; default: the input dtype); "
                            "repeat for several operands")
    group.add_argument("--table-period", action="append", metavar="NAME=P",
                       help="column count P of a Table operand, baked into the kernel (default: read at run time)")
    group.add_argument("--stage-tables", action="store_true",
                       help="load Table operands' subtile slices into smem with TMA instead of gathering them (needs "
                            "every table's --table-period; the runtime does this for tables whose rows R are a "
                            "multiple of the tile's rows, P a multiple of 32)")
    group.add_argument("--finish-in-gemm", action="store_true",
                       help="reductions: the last tile of each row (column) of tiles folds the partials, instead of "
                            "a second kernel (the runtime does this for calls too small to keep the GPU busy)")
    group.add_argument("--unroll-subtiles", action=argparse.BooleanOptionalAction, default=None,
                       help="sm_90a: unroll the epilogue's subtile loop while tracing, or leave LLVM a loop (a third "
                            "quicker to compile; default: unrolled for ping-pong, as the runtime builds large calls)")
    if not several:
        group.add_argument("--ab-stages", type=int, default=0, metavar="S",
                           help="mainloop stages, 2..8; fewer leave shared memory for deeper epilogue input rings "
                                "(default 0: planned, at least 4 where they fit)")
        group.add_argument("--epi-stages", type=int, default=0, metavar="S",
                           help="subtiles each epilogue output ring holds (stores in flight), 2..16 dividing the "
                                "tile's subtile count (default 0: planned)")
        group.add_argument("--in-stages", type=int, default=0, metavar="S",
                           help="subtiles each epilogue input ring holds (how far its loads run ahead), 2..16 "
                                "dividing the tile's subtile count (default 0: planned)")
        group.add_argument("--raster", default="m", metavar="{m,n}",
                           help="order of the persistent tile scheduler: down M first or across N (default m)")
        group.add_argument("--swizzle", type=int, default=DEFAULT_SWIZZLE, metavar="S",
                           help=f"walk tiles in bands of S cluster columns (rows with --raster n), "
                                f"{', '.join(map(str, SWIZZLES))}; 1 walks whole columns (default {DEFAULT_SWIZZLE})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="GEMM + epilogue programs as readable CuTe-DSL Hopper kernels.",
        epilog="Emitted kernels print the command that regenerates them in their header.")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("list", help="the library's programs, one line each")
    p.add_argument("--names", action="store_true", help="only the names, one per line")
    p.set_defaults(run=cmd_list)

    p = sub.add_parser("show", help="a program's operands, values and outputs")
    p.add_argument("name", metavar="PROGRAM", help=PROGRAM_HELP)
    p.add_argument("--backward", action="store_true", help="the program's derived backward (coda_cute.derive)")
    p.set_defaults(run=cmd_show)

    p = sub.add_parser("emit", help="print or write the CuTe-DSL source of a kernel")
    p.add_argument("name", metavar="PROGRAM", help=PROGRAM_HELP)
    p.add_argument("--backward", action="store_true", help="the program's derived backward (coda_cute.derive)")
    _add_config_flags(p)
    p.add_argument("-o", "--output", metavar="FILE", help="write the source to FILE instead of stdout")
    p.add_argument("--compile", action="store_true",
                   help="also compile it for --arch (no GPU needed) and print the compile time")
    p.set_defaults(run=cmd_emit)

    p = sub.add_parser("inspect", help="compile a kernel for --arch (no GPU needed) and show what came out",
                       description="Compile a kernel for --arch without a GPU and print the requested parts "
                                   "(default: --regs).")
    p.add_argument("name", metavar="PROGRAM", help=PROGRAM_HELP)
    p.add_argument("--backward", action="store_true", help="the program's derived backward (coda_cute.derive)")
    _add_config_flags(p)
    p.add_argument("--source", action="store_true", help="the emitted CuTe-DSL source")
    p.add_argument("--ptx", action="store_true", help="the PTX")
    p.add_argument("--sass", action="store_true", help="the SASS (nvdisasm of the cubin)")
    p.add_argument("--regs", action="store_true", help="ptxas' register and spill report")
    p.add_argument("--dump-dir", metavar="DIR", help="keep the PTX / cubin / SASS files in DIR")
    p.set_defaults(run=cmd_inspect)

    p = sub.add_parser("cache", help="the disk cache of compiled kernels ($CODA_CUTE_CACHE_DIR)")
    p.add_argument("action", choices=("ls", "clear", "path"),
                   help="ls: list the kernels; clear: delete them; path: print the folder")
    p.set_defaults(run=cmd_cache)

    p = sub.add_parser("precompile", help="compile kernels into the disk cache ahead of time",
                       description="Compile every program x configuration into the disk cache, in parallel "
                                   "worker processes, so later runs load instead of compiling.")
    p.add_argument("names", nargs="*", metavar="PROGRAM", help=PROGRAM_HELP + " (or --all)")
    p.add_argument("--all", action="store_true", help="every library program (those a config cannot build are skipped)")
    _add_config_flags(p, several=True)
    p.add_argument("-j", "--jobs", type=int, default=None, metavar="N",
                   help=f"worker processes (default: one per CPU, {os.cpu_count()} here)")
    p.set_defaults(run=cmd_precompile)

    p = sub.add_parser("tune", help="time the candidate tiles of a program at one shape on this GPU, keep the "
                                    "fastest", description="Compile the candidates (cache.tune_candidates), time "
                                    "those that do not spill on random inputs of the shape, and record the fastest "
                                    "beside the kernels: Kernel(program, autotune=True) at that shape runs it.")
    p.add_argument("name", metavar="PROGRAM", help=PROGRAM_HELP)
    p.add_argument("--backward", action="store_true", help="the program's derived backward")
    p.add_argument("--shape", required=True, metavar="MxNxK", help="A is M x K, B is N x K")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "f16"), help="A and B (default bf16)")
    p.set_defaults(run=cmd_tune)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the ``coda-cute`` command; returns the exit status (2 for errors the user can fix)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, or argparse's own usage error (status 2)
        return exc.code if isinstance(exc.code, int) else 2
    try:
        return args.run(args)
    except CodaError as exc:
        _note(f"{PROG}: error: {exc}")
        return 2
    except BrokenPipeError:  # e.g. `coda-cute emit gemm | head`
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return 0
    except KeyboardInterrupt:
        _note(f"{PROG}: interrupted")
        return 130


if __name__ == "__main__":  # python -m coda_cute.cli
    sys.exit(main())

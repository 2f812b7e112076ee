"""Rendering: the lowered context through the Jinja template into one standalone Python module."""

from __future__ import annotations

from functools import lru_cache

import jinja2

from .backends.registry import backend
from .config import KernelConfig, unrolled_subtiles
from . import library
from .library import resource_dir
from .lower import Context, lower
from .program import Program
from .version import __version__
from .wrap import WIDTH, fit_code, wrap_command, wrap_items, wrap_prose

@lru_cache(maxsize=1)
def environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(resource_dir("templates"))),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )


def program_reference(program: Program) -> str | None:
    """What ``coda-cute emit`` takes to find ``program`` again: its library name, the
    ``--backward`` of a program it was derived from, or where its function was defined
    (``module:name``, ``file.py:name``); None for a program built in Python in some other way
    (a variant, a function defined inside another)."""
    if library.programs().get(program.name) is program:
        return program.name
    if program.derived_from is not None:
        forward = program_reference(program.derived_from)
        return None if forward is None else f"--backward {forward}"
    return program.origin


def emit_command(program: Program, config: KernelConfig, reference: str | None = None) -> str:
    """The CLI line that regenerates this kernel (printed in its header).  ``reference``: how the
    command names the program (default ``program_reference``)."""
    reference = reference or program_reference(program)
    if reference is None:
        return "coda_cute.render.emit(program, config): no command names a program built this way"
    parts = [f"coda-cute emit {reference} --arch {config.arch} --gpu {config.gpu} --dtype {config.dtype}",
             f"--majors {config.majors} --tile {config.tile[0]}x{config.tile[1]}",
             f"--cluster {config.cluster[0]}x{config.cluster[1]} --schedule {config.schedule} --swizzle {config.swizzle}"]
    parts += [f"--operand-dtype {name}={dtype}" for name, dtype in config.operand_dtypes if dtype != config.dtype]
    parts += [f"--table-period {name}={period}" for name, period in config.table_periods]
    parts += [f"--ab-stages {config.ab_stages}"] if config.ab_stages else []
    parts += [f"--epi-stages {config.epi_stages}"] if config.epi_stages else []
    parts += [f"--in-stages {config.in_stages}"] if config.in_stages else []
    parts += [] if config.raster_along_m else ["--raster n"]
    parts += ["--stage-tables"] if config.stage_tables else []
    parts += ["--finish-in-gemm"] if config.finish_in_gemm else []
    if config.unroll_subtiles != unrolled_subtiles(config.schedule, config.arch):  # not the CLI's default
        parts += ["--unroll-subtiles" if config.unroll_subtiles else "--no-unroll-subtiles"]
    return " ".join(parts)


def docstring_text(line: str) -> str:
    """``line`` as it may stand inside the emitted module's triple-quoted docstring: backslashes
    and non-printable characters escaped, no run of three quotes, so no text a user wrote (a
    program's docstring) can end the string or change what it says."""
    escaped = "".join(c if c.isprintable() and c != "\\" else c.encode("unicode_escape").decode("ascii")
                      for c in line)
    return escaped.replace('"""', '\\"\\"\\"')


def render(ctx: Context, *, reference: str | None = None) -> str:
    """The module's source.  Every text from the user reaches it through here: the program is
    validated again (names and hints are identifiers, constants numbers) and its listing, which
    quotes the docstring, is escaped for the module docstring.  Lines are at most WIDTH
    characters: the docstring's are wrapped here, code lines by the template or by fit_code."""
    config = ctx.config
    ctx.program.validate()
    target = backend(config.arch)
    template = environment().get_template(target.template)
    listing = [docstring_text(line) for line in ctx.program.describe().splitlines()]
    return fit_code(template.render(
        version=__version__,
        command_lines=wrap_command(emit_command(ctx.program, config, reference), indent=4),
        program_listing=[part for line in listing for part in wrap_prose(line, WIDTH - 4)],
        call_lines=wrap_items(f"Call ({ctx.class_name}.__call__): {ctx.call_signature}"),
        fast_tiles=ctx.fast_tiles,
        inputs_in_registers=ctx.inputs_in_registers,
        table_gather=ctx.table_gather(),
        table_slot=target.table_slot,
        uses=ctx.uses,
        **vars(ctx),
    ))


def emit(program: Program, config: KernelConfig | None = None, *, reference: str | None = None) -> str:
    """The CuTe-DSL source of ``program`` under ``config``: one readable, standalone module.
    ``reference``: how its header's regenerate command names the program (see ``emit_command``)."""
    config = config or KernelConfig()
    return render(lower(program, config), reference=reference)

"""The disk cache filled ahead of time: every (program, config) of a list compiled in a pool of
worker processes (``coda-cute precompile``), so later runs load kernels instead of compiling them.

    from coda_cute.precompile import precompile
    precompile(["swiglu", "residual_sumsq"], [KernelConfig(tile=(128, 256))], jobs=8)
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import time
from dataclasses import dataclass
from typing import Callable, Iterable

from . import library
from .cache import REASONS, cache_key, get_default_kernel, get_kernel, rejection, short_config
from .config import KernelConfig, parse_operand_dtypes
from .errors import UnsupportedError
from .lower import lower
from .program import Program
from .render import program_reference


@dataclass
class PrecompileResult:
    """One (program, config) of a ``precompile`` run."""

    program: str
    config: KernelConfig
    status: str  # "compiled", "disk" or "memory" (where get_kernel found it), "skipped" or "failed"
    seconds: float = 0.0  # wall time in the worker (render + compile + export, or load)
    path: str | None = None  # the cache entry's folder
    message: str = ""  # why it was skipped or failed
    chosen: KernelConfig | None = None  # with ``decide``: the configuration calls run (``config`` or a fallback)
    why: str = ""  # with ``decide``, where ``chosen`` is a fallback: why ``config`` is not run

    @property
    def ok(self) -> bool:
        return self.status in ("compiled", "disk", "memory")

    def line(self) -> str:
        what = f"{self.program} {short_config(self.config)}"
        if self.ok:
            fallback = "" if self.chosen in (None, self.config) else (
                f"; {self.why or 'decided before'}, so calls run tile {self.chosen.tile[0]}x{self.chosen.tile[1]} "
                f"{self.chosen.schedule}")
            return f"{what}: {self.seconds:.2f} s ({self.status}){fallback}"
        return f"{what}: {self.status} ({self.message})"


def _plain(program: Program) -> Program:
    """A picklable copy (the @epilogue subclass keeps its Python function, which may not pickle)
    that still names itself the same way in its kernel's header."""
    return Program(program.name, program.operands, program.outputs, program.doc, origin=program_reference(program),
                   a_transform=program.a_transform)


def _compile_one(program: Program, config: KernelConfig,
                 decide: bool) -> tuple[str, float, str | None, KernelConfig | None, str]:
    """Worker: compile (or find) one kernel in the disk cache, or with ``decide`` the default
    kernel for ``config`` ("compiled" where any candidate was), the configuration it chose and,
    where that is a fallback decided now, why."""
    start = time.perf_counter()
    why = ""
    if decide:
        default = get_default_kernel(program, config)
        entry, chosen = default.entry, default.config
        origin = "compiled" if any(e.origin == "compiled" for _, e in default.tried) else entry.origin
        if default.tried:  # decided now: why the rules' choice (tried first) is not run
            asked, first = default.tried[0]
            why = REASONS.get(rejection(asked, first), "")
    else:
        entry, chosen = get_kernel(program, config), None
        origin = entry.origin
    return origin, time.perf_counter() - start, (str(entry.path) if entry.path else None), chosen, why


def precompile(programs: Iterable[Program | str], configs: Iterable[KernelConfig], *, jobs: int | None = None,
               progress: Callable[[str], None] | None = None) -> list[PrecompileResult]:
    """Compile every (program, config) of the cross product into the disk cache, ``jobs``
    processes at a time (default: one per CPU).  ``programs`` are Programs or library names.

    Each config is first put in the form the runtime asks the cache for (``KernelConfig.resolved``:
    every tensor operand's dtype spelled out), so later ``Kernel(program)(...)`` calls with those
    settings find the kernels.  Pairs the generator cannot build come back "skipped" without
    compiling; pairs with the same cache key are built once.  ``progress`` gets a line per
    finished kernel, "[i/n] name config: 1.23 s (compiled)".  The workers are fresh (spawned)
    processes that share the disk cache (``cache_dir()``) and receive each program as its IR
    (any Program works, including ones traced inside a function); as with any spawn pool, a
    script that calls this must do so under ``if __name__ == "__main__":``.
    """
    resolved = [library.get(p) if isinstance(p, str) else p for p in programs]
    configs = list(configs)
    return precompile_pairs([(p, c) for p in resolved for c in configs], jobs=jobs, progress=progress)


def precompile_pairs(pairs: Iterable[tuple[Program, KernelConfig]], *, jobs: int | None = None,
                     progress: Callable[[str], None] | None = None, decide: bool = False) -> list[PrecompileResult]:
    """``precompile`` for an explicit list of (program, config) pairs.  With ``decide`` each config
    is the runtime's rules' choice for calls that fix none of tile, cluster and schedule, and its
    default is decided and recorded (``get_default_kernel``: the fallbacks compile where it spills)."""
    results: list[PrecompileResult] = []
    tasks: list[tuple[Program, KernelConfig]] = []
    seen: set[str] = set()
    for program, config in pairs:
        try:
            parse_operand_dtypes(program, [f"{n}={d}" for n, d in config.operand_dtypes])
            config = config.resolved(program).check()
            lower(program, config)  # cheap, and runs every check a compile would fail on
        except UnsupportedError as exc:
            results.append(PrecompileResult(program.name, config, "skipped", message=str(exc)))
            continue
        key = cache_key(program, config)
        if key not in seen:
            seen.add(key)
            tasks.append((program, config))
    if not tasks:
        return results
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(tasks)))
    context = multiprocessing.get_context("spawn")  # the DSL's compiler state does not survive fork
    with concurrent.futures.ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
        futures = {pool.submit(_compile_one, _plain(p), c, decide): (p, c) for p, c in tasks}
        for done, future in enumerate(concurrent.futures.as_completed(futures), 1):
            program, config = futures[future]
            try:
                origin, seconds, path, chosen, why = future.result()
                result = PrecompileResult(program.name, config, origin, seconds, path, chosen=chosen, why=why)
            except Exception as exc:  # a compiler failure, or a worker that died: report it, go on
                text = str(exc).strip()
                first = text.splitlines()[0] if text else ""
                result = PrecompileResult(program.name, config, "failed", message=f"{type(exc).__name__}: {first}")
            results.append(result)
            if progress:
                progress(f"[{done}/{len(tasks)}] {result.line()}")
    return results

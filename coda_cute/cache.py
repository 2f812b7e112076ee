"""The kernel cache: in memory, and on disk across processes.

Key = sha256 of everything that can change the compiled kernel (``key_fields``):
program fingerprint, kernel config (arch, GPU, dtypes, majors, tile, cluster), the
template and generator sources, and the CuTe DSL / TVM-FFI versions and library flavor.
Anything missing from that list would let a stale kernel be loaded, so it fails closed:
if a version cannot be read, the key says "unknown" and nothing old matches it.

Disk layout (``cache_dir()``):

    <root>/<key[:2]>/<key>/kernel.o        exported object (TVM-FFI), loaded with load_module
                          kernel.py        the emitted source it was compiled from
                          manifest.json    key fields, versions, compile time, sha256 of both files
    <root>/locks/<key>.lock                held while one process compiles that key
    <root>/defaults/<key>.json             the configuration calls run where the kernel asked for
                                           by the runtime's rules spills (``get_default_kernel``)
    <root>/tuned/<key>-<M>x<N>x<K>.json    the fastest configuration at that shape, where calls
                                           asked for it (``Kernel(..., autotune=True)``)

Native code is loaded from here, so nothing is loaded that someone else could have written:
the root, its parents, and every folder and file of an entry must belong to you (or to root,
for a cache an administrator prepared) and be writable by nobody else (sticky parents such
as /tmp excepted), entries must be plain folders and files (no links), and both files must
match the manifest's checksums.  A root that fails these checks is not used at all (kernels
stay in memory, with one warning); an entry that fails them is never loaded and is rebuilt.
A root you cannot write (your own read-only folder, or one owned by root) is used read-only:
its entries load, new kernels stay in memory.  Writing is best effort: a full disk or a
vanished folder costs a warning, never a call.

An entry is written into a temporary folder and renamed into place, so readers see a whole
entry or none; whatever else sits at an entry's path (an interrupted write or ``clear``, a
stray file) is removed and rebuilt by the process holding that key's lock.  A default or
tuning record is one file, written the same way and checked the same way before it is read;
it can only name one of its candidates (``default_candidates(config)``, ``tune_candidates``).
Every process that decides a default writes the same record, so no lock is needed; two that
tune one shape at once may pick different winners of a near tie, and the last one written stays.

``precompile`` (the module after this one) fills the disk cache ahead of time from a pool of
worker processes (the ``coda-cute precompile`` command), so later runs load kernels instead of
compiling them.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import stat
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from . import library
from .backends.registry import backend
from .config import KernelConfig, unrolled_subtiles
from .errors import UnsupportedError
from .program import Program

if TYPE_CHECKING:
    from .compile import CompiledKernel

ENV_DIR = "CODA_CUTE_CACHE_DIR"
ENV_DISABLE = "CODA_CUTE_NO_DISK_CACHE"
#: seconds a process waits for another one compiling the same key before compiling it too
LOCK_TIMEOUT = 300.0
_FILES = ("kernel.o", "kernel.py")


class CacheWarning(UserWarning):
    """The disk cache could not be used as asked; kernels stay in memory."""


@dataclass
class CacheEntry:
    key: str
    function: object  # TVM-FFI callable taking torch tensors
    source: str
    origin: str  # "compiled", "disk" or "memory"
    path: Path | None
    seconds: float  # compile or load time
    stack_frame_bytes: int | None = None  # CompiledKernel.stack_frame_bytes, kept in the manifest
    instructions: int | None = None  # CompiledKernel.instructions, kept in the manifest
    local_accesses: int | None = None  # CompiledKernel.local_accesses, kept in the manifest


_MEMORY: dict[str, CacheEntry] = {}
_KEY_LOCKS: dict[str, threading.Lock] = {}
_LOCK = threading.Lock()  # guards the two dicts above, held only to read or add to them
_COMPILE_LOCK = threading.Lock()  # one cute.compile at a time per process (the DSL's compiler state)
_WARNED: set[str] = set()


def cache_dir() -> Path:
    """$CODA_CUTE_CACHE_DIR, else $XDG_CACHE_HOME/coda-cute, else ~/.cache/coda-cute."""
    root = os.environ.get(ENV_DIR)
    if not root:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(base, "coda-cute")
    return Path(root)


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, CacheWarning, stacklevel=4)


# ----------------------------------------------------------------------------- trust
def _trusted_owner(uid: int) -> bool:
    return uid in (os.geteuid(), 0)


def _untrusted(path: Path, *, want_dir: bool, follow: bool = False) -> str | None:
    """Why ``path`` may not be trusted, or None: it must be a folder (or a plain file) owned by
    you or root and writable by nobody else; with ``follow``, a link to such a thing is fine."""
    info = os.stat(path) if follow else os.lstat(path)
    kind = stat.S_ISDIR(info.st_mode) if want_dir else stat.S_ISREG(info.st_mode)
    if not kind:
        return f"{path} is not a {'folder' if want_dir else 'plain file'}"
    if not _trusted_owner(info.st_uid):
        return f"{path} belongs to uid {info.st_uid}, not to you (uid {os.geteuid()}) or root"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{path} is writable by {'group' if info.st_mode & stat.S_IWGRP else 'others'}"
    return None


def _untrusted_parents(path: Path) -> str | None:
    """Why the folders above ``path`` could let someone else replace it, or None: each must be
    owned by you or root and writable by nobody else, unless sticky (like /tmp)."""
    for parent in path.parents:
        info = os.stat(parent)
        open_to_others = info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not info.st_mode & stat.S_ISVTX
        if not _trusted_owner(info.st_uid) or open_to_others:
            return f"{parent} (above the cache) can be changed by uid {info.st_uid} or others"
    return None


def _open_root() -> tuple[Path | None, bool]:
    """(the cache root, whether this process may write it), or (None, False) where it may not
    be used at all (then one warning says why)."""
    if os.environ.get(ENV_DISABLE):
        return None, False
    root = cache_dir()
    try:
        if not root.exists():
            root.mkdir(parents=True, mode=0o700)
            os.chmod(root, 0o700)  # mkdir's mode is masked by the umask
        root = root.resolve()
        why = _untrusted(root, want_dir=True) or _untrusted_parents(root)
    except OSError as exc:
        why = f"{root} cannot be used ({exc.strerror or exc})"
    if why:
        _warn_once(f"coda-cute kernel cache not used: {why}; compiled kernels stay in memory "
                   f"(set {ENV_DIR} to a private folder)")
        return None, False
    info = os.lstat(root)  # the owner's write bit, not os.access: root may write anywhere, but a
    writable = info.st_uid == os.geteuid() and bool(info.st_mode & stat.S_IWUSR)  # read-only folder says "don't"
    if not writable:
        _warn_once(f"coda-cute kernel cache {root} is read-only for you: its kernels load, new ones stay in memory")
    return root, writable


# ----------------------------------------------------------------------------- keys
@lru_cache(maxsize=1)
def environment_fields() -> dict:
    """Versions of what compiles and loads kernels; 'unknown' never matches an old entry."""
    fields = {}
    try:
        import cutlass

        fields["cutlass_dsl"] = cutlass.__version__
        root = Path(cutlass.__file__).resolve().parents[2]
        fields["dsl_flavor"] = ",".join(sorted(p.name for p in root.glob("cu1*") if p.is_dir())) or "unknown"
    except Exception:  # pragma: no cover - no DSL installed
        fields["cutlass_dsl"] = fields["dsl_flavor"] = f"unknown-{time.time_ns()}"
    try:  # from its installed metadata: importing tvm_ffi costs 20-40 ms, and only the load needs it
        fields["tvm_ffi"] = importlib.metadata.version("apache-tvm-ffi")
    except importlib.metadata.PackageNotFoundError:  # installed some other way: ask the module
        try:
            import tvm_ffi

            fields["tvm_ffi"] = tvm_ffi.__version__
        except Exception:
            fields["tvm_ffi"] = f"unknown-{time.time_ns()}"
    fields["generator"] = generator_digest()
    return fields


def generator_digest() -> str:
    """sha256 over every source file of the package and every template: a change anywhere in
    the generator gives new keys, with no list of files to keep up to date."""
    here = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    files = sorted(here.rglob("*.py")) + sorted(library.resource_dir("templates").rglob("*.j2"))
    for path in files:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def key_fields(program: Program, config: KernelConfig) -> dict:
    config = config.resolved(program)
    return {"program": program.fingerprint, "config": list(map(_jsonable, config.key())), **environment_fields()}


def cache_key(program: Program, config: KernelConfig) -> str:
    return hashlib.sha256(json.dumps(key_fields(program, config), sort_keys=True).encode()).hexdigest()


def _jsonable(value):
    return [_jsonable(v) for v in value] if isinstance(value, (tuple, list)) else value


# ----------------------------------------------------------------------------- get
def get_kernel(program: Program, config: KernelConfig) -> CacheEntry:
    """The compiled kernel for (program, config): from memory, disk, or a fresh compile.

    Threads asking for one key wait for each other; other keys go on (loads in parallel,
    compiles one at a time)."""
    config = config.resolved(program)
    key = cache_key(program, config)
    entry = _MEMORY.get(key)
    if entry is not None:
        return entry
    with _LOCK:
        key_lock = _KEY_LOCKS.setdefault(key, threading.Lock())
    with key_lock:
        entry = _MEMORY.get(key)
        if entry is None:
            entry = _load_or_compile(program, config, key)
            _MEMORY[key] = entry
    return entry


def _load_or_compile(program: Program, config: KernelConfig, key: str) -> CacheEntry:
    root, writable = _open_root()
    if root is None:
        return _compile(program, config, key)
    folder = root / key[:2] / key
    entry = _load(folder, key)
    if entry is not None or not writable:
        return entry or _compile(program, config, key)
    import filelock  # here, not at the top: a warm load never locks, and importing it takes ~10 ms

    try:
        locks = _private_subdir(root / "locks")
        lock = filelock.FileLock(str(locks / f"{key}.lock"), timeout=LOCK_TIMEOUT)
        lock.acquire()
    except filelock.Timeout:
        _warn_once(f"waited {LOCK_TIMEOUT:.0f} s for another process compiling into {root}; compiling here too")
        lock = None
    except OSError as exc:
        _warn_once(f"coda-cute kernel cache {root}: cannot lock ({exc.strerror or exc}); kernels stay in memory")
        return _compile(program, config, key)
    try:
        entry = _load(folder, key)  # the lock holder before us may have written it
        if entry is None:
            entry = _compile(program, config, key)
            _store(entry, program, config, folder)
    finally:
        if lock is not None:
            lock.release()
    return entry


def _private_subdir(path: Path) -> Path:
    """A folder of the cache root: created private, else it must pass the trust checks (a stray
    file or link in its place is removed first)."""
    if os.path.lexists(path) and (path.is_symlink() or not path.is_dir()):
        path.unlink()
    try:
        path.mkdir(mode=0o700)
        os.chmod(path, 0o700)
    except FileExistsError:
        why = _untrusted(path, want_dir=True)
        if why:
            raise PermissionError(why) from None
    return path


def _load(folder: Path, key: str) -> CacheEntry | None:
    """The entry at ``folder`` if everything in it passes the trust checks and matches its
    manifest, else None (nothing from it is loaded)."""
    manifest_path = folder / "manifest.json"
    try:
        if not manifest_path.exists():
            return None
        why = (_untrusted(folder.parent, want_dir=True) or _untrusted(folder, want_dir=True)
               or next(filter(None, (_untrusted(folder / n, want_dir=False) for n in ("manifest.json", *_FILES))), None))
        if why:
            _warn_once(f"coda-cute kernel cache: not loading {folder.name[:12]}: {why}")
            return None
        manifest = json.loads(manifest_path.read_text())
        source = (folder / "kernel.py").read_bytes()
        if (not isinstance(manifest, dict) or manifest.get("key") != key
                or manifest.get("object_sha256") != _sha256(folder / "kernel.o")
                or manifest.get("source_sha256") != hashlib.sha256(source).hexdigest()):
            return None
        start = time.perf_counter()
        from cutlass.cute.runtime import load_module

        function = load_module(str(folder / "kernel.o"), enable_tvm_ffi=True)["func"]
        frame, instructions, accesses = (manifest.get(field) for field in
                                         ("stack_frame_bytes", "instructions", "local_accesses"))
        frame = frame if type(frame) is int and frame >= 0 else None
        instructions = instructions if type(instructions) is int and instructions > 0 else None
        accesses = accesses if type(accesses) is int and accesses >= 0 else None
        return CacheEntry(key, function, source.decode(), "disk", folder, time.perf_counter() - start, frame,
                          instructions, accesses)
    except Exception:  # unreadable, half-written, or refused by the loader: rebuilt by the lock holder
        return None


def _compile(program: Program, config: KernelConfig, key: str) -> CacheEntry:
    from .compile import compile_program

    with _COMPILE_LOCK:
        compiled = compile_program(program, config, tvm_ffi=True)
    return CacheEntry(key, compiled.function, compiled.source, "compiled", None, compiled.compile_seconds,
                      compiled.stack_frame_bytes, compiled.instructions, compiled.local_accesses)


def _store(entry: CacheEntry, program: Program, config: KernelConfig, folder: Path) -> None:
    """Write ``entry`` at ``folder`` (caller holds the key's lock); on failure warn, keep it in memory."""
    try:
        shard = _private_subdir(folder.parent)
        _remove_leftovers(folder, shard)
        staging = Path(tempfile.mkdtemp(prefix=f".{entry.key[:8]}-", dir=shard))
        try:
            entry.function.export_to_c(object_file_path=str(staging / "kernel.o"), function_name="func")
            (staging / "kernel.py").write_text(entry.source)
            manifest = {
                "key": entry.key,
                "fields": key_fields(program, config),
                "program": program.name,
                "config": config.describe(),
                "compile_seconds": round(entry.seconds, 3),
                "stack_frame_bytes": entry.stack_frame_bytes,
                "instructions": entry.instructions,
                "local_accesses": entry.local_accesses,
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "object_sha256": _sha256(staging / "kernel.o"),
                "source_sha256": hashlib.sha256(entry.source.encode()).hexdigest(),
            }
            (staging / "manifest.json").write_text(json.dumps(manifest, indent=1))
            for name in ("manifest.json", *_FILES):
                os.chmod(staging / name, 0o600)  # whatever the umask: readable and writable by you only
            os.rename(staging, folder)  # atomic: readers see the whole entry or none
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        entry.path = folder
    except OSError as exc:
        _warn_once(f"coda-cute kernel cache: cannot write {folder.parent.parent} ({exc.strerror or exc}); "
                   "compiled kernels stay in memory")


def _remove_leftovers(folder: Path, shard: Path) -> None:
    """Clear the way for a new entry: whatever is at ``folder`` (an entry without a manifest, a
    stray file, a damaged or untrusted entry) and this key's staging folders that an interrupted
    write left behind (only the lock holder makes them, so any seen now are stale)."""
    if os.path.lexists(folder):
        if folder.is_dir() and not folder.is_symlink():
            shutil.rmtree(folder)
        else:
            folder.unlink()
    for stale in shard.glob(f".{folder.name[:8]}-*"):
        shutil.rmtree(stale, ignore_errors=True)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else ""


# ----------------------------------------------------------------------------- default configurations
#: Where the kernel of the runtime's choice spills registers, a call that fixed none of tile,
#: cluster and schedule runs the first of these (tile, schedule) that does not (get_default_kernel):
#: cooperative 128x256 leads for large outputs (and a GLU with its saved pre-activation ran 5 %
#: faster there, spill-free, than spilling at ping-pong 128x192); ping-pong 128x192 leads for heavy
#: epilogues up to K = 4096 and gives its consumers 240 registers; cooperative 128x128 holds the
#: fewest accumulators per thread (64) of the tiles the runtime picks itself
SPILL_FALLBACKS = (((128, 256), "cooperative"), ((128, 192), "pingpong"), ((128, 128), "cooperative"))


#: A ping-pong 128x192 consumer holds 192 fp32 accumulators of its 240 registers: an epilogue with
#: much math per element has no registers left for instruction-level parallelism there, runs
#: latency-bound and outlasts the other warpgroup's mainloop it should hide behind.  Where the
#: rules' choice is that tile and its kernel has more SASS instructions per accumulator than
#: this, calls run ping-pong 128x128 (128 accumulators) instead, if it does not spill.  H100,
#: 8192x4096x4096 (benchmarks/results, "Programs nobody tuned"): random_11 of bench_programs (55
#: instructions per accumulator at 128x192) ran 1.88x our GEMM there and 1.04x at 128x128; the
#: heaviest others at 128x192, random_1 (35) and the SwiGLU backward with h (33), 0.99x and 1.06x
LATENCY_BOUND = ((128, 192), "pingpong", 45)
LATENCY_FALLBACK = ((128, 128), "pingpong")


def _accumulators(config: KernelConfig) -> int:
    """fp32 accumulators each epilogue thread of ``config`` holds."""
    rows, cols = backend(config.arch).cta_tile(config.tile)
    return rows * cols // backend(config.arch).tile_threads(config)


def latency_bound(config: KernelConfig, instructions: int | None) -> bool:
    """Whether a kernel of ``config`` with ``instructions`` SASS instructions (its cubin's, None:
    unknown) is one LATENCY_BOUND describes."""
    tile, schedule, limit = LATENCY_BOUND
    return (tuple(config.tile) == tile and config.schedule == schedule and instructions is not None
            and instructions > limit * _accumulators(config))


#: The most loads and stores of local memory (spill code: ``CompiledKernel.local_accesses``) a
#: kernel's SASS may hold and still run as a default.  The epilogue is unrolled, so each runs
#: about once per tile: a few values ptxas parks while the epilogue needs their registers.  H100,
#: benchmarks/results "Spills that cost nothing": cross_entropy_stats_save at ping-pong 128x192
#: (10: a 24-byte frame stored as the epilogue starts, loaded at its end) ran 12.60 ms against
#: 13.63 at its spill-free cooperative 128x256 (8192 x 128256 x 4096); swiglu_bwd_recompute at
#: cooperative 128x256 (14, frame 24-32 bytes by ptxas version) 5.84 against 6.03 at its
#: spill-free ping-pong 128x192 (8192 x 28672 x 8192).  RMSNorm's backward at ping-pong 128x192,
#: which runs slower, holds 78 (rmsnorm_bwd_residual 114)
SPILL_TOLERATED_ACCESSES = 16

#: each ``rejection`` in words, as `precompile` and `inspect` tell it
REASONS = {"spills": "it spills", "latency-bound": "its epilogue runs latency-bound there"}


def spills(kernel: CacheEntry | CompiledKernel) -> bool:
    """Whether ``kernel`` spills registers in more places than SPILL_TOLERATED_ACCESSES: it has a
    stack frame (unknown: taken as none) and more spill code than that, or spill code not counted."""
    accesses = kernel.local_accesses
    return bool(kernel.stack_frame_bytes) and (accesses is None or accesses > SPILL_TOLERATED_ACCESSES)


def rejection(config: KernelConfig, kernel: CacheEntry | CompiledKernel) -> str | None:
    """Why ``kernel``, built for ``config``, is not run as a default: "spills" (``spills``),
    "latency-bound" (``latency_bound`` of its SASS length, checked only where it does not spill),
    or None where nothing speaks against it."""
    if spills(kernel):
        return "spills"
    return "latency-bound" if latency_bound(config, kernel.instructions) else None


def default_candidates(config: KernelConfig, latency: bool = False) -> list[KernelConfig]:
    """``config`` (the runtime's choice for a call that fixed none of tile, cluster and schedule),
    then the SPILL_FALLBACKS of another schedule, or of its own holding fewer fp32 accumulators
    per thread (with as many and the same register budget, the epilogue has no more room), with
    its cluster and every other field (the subtile loop in the form ``unrolled_subtiles`` gives
    their schedule, ``config``'s own where the schedule is its own); with ``latency``
    (``config``'s kernel is latency_bound), LATENCY_FALLBACK right after it.  Each sm_90a
    ping-pong candidate is followed by its twin with the subtile loop in the other form
    (``KernelConfig.unroll_subtiles``), which ``get_default_kernel`` builds only where the
    candidate spills."""
    fallbacks = [reshaped(config, tile, schedule) for tile, schedule in SPILL_FALLBACKS]
    if latency:
        fallbacks.insert(0, reshaped(config, *LATENCY_FALLBACK))
    candidates = [config] + [c for c in fallbacks
                             if c.schedule != config.schedule or _accumulators(c) < _accumulators(config)]
    return _with_twins(candidates)


def reshaped(config: KernelConfig, tile: tuple[int, int], schedule: str, cluster=None) -> KernelConfig:
    """``config`` with another tile and schedule (and cluster), its subtile loop in the form
    ``unrolled_subtiles`` gives that schedule, or in ``config``'s own where the schedule is its own."""
    unrolled = config.unroll_subtiles if schedule == config.schedule else unrolled_subtiles(schedule, config.arch)
    return config.with_(tile=tile, schedule=schedule, cluster=cluster or config.cluster, unroll_subtiles=unrolled)


def _twin(config: KernelConfig) -> tuple[KernelConfig, ...]:
    """The same ping-pong kernel with its subtile loop in the other form (``KernelConfig.unroll_subtiles``):
    ptxas spilled heavy ping-pong epilogues from the IR loop and not unrolled while tracing."""
    if config.schedule != "pingpong" or config.arch != "sm_90a":
        return ()
    return (config.with_(unroll_subtiles=not config.unroll_subtiles),)


def _with_twins(candidates: list[KernelConfig]) -> list[KernelConfig]:
    """``candidates``, each followed by its ``_twin`` where it has one."""
    return [twin for c in candidates for twin in (c, *_twin(c))]


_DEFAULTS: dict[str, KernelConfig] = {}  # cache key of the rules' choice -> the configuration calls run


@dataclass
class DefaultKernel:
    """What ``get_default_kernel`` found: the configuration calls run and its kernel."""

    config: KernelConfig
    entry: CacheEntry
    #: the candidates compiled or loaded to decide, in order (empty where the decision was kept)
    tried: list[tuple[KernelConfig, CacheEntry]]


def get_default_kernel(program: Program, config: KernelConfig) -> DefaultKernel:
    """The kernel a call runs when it fixed none of tile, cluster and schedule: ``config`` (the
    runtime's rules' choice) unless its kernel spills registers or is ``latency_bound``, then the
    first of the fallbacks in ``default_candidates`` (LATENCY_FALLBACK first where ``config``
    is latency-bound without spilling; a ping-pong kernel's twin, its subtile loop in the other
    form, right after it where it spills) that is neither; else the first of them that does not
    spill (``config`` where every one does).

    Spills are read from each kernel's stack frame (``CompiledKernel.stack_frame_bytes``) and
    its length from its SASS (``CompiledKernel.instructions``), both free at compile time and kept
    in the manifest; a kernel whose frame or length is unknown is taken as it is.  Candidates
    compile into the cache like any kernel, and the decision is kept in memory and on disk
    (``<root>/defaults/<key>.json``, key: the rules' choice's ``cache_key``), so a later call or
    process goes straight to the chosen kernel and nothing is compiled twice."""
    config = config.resolved(program)
    key = cache_key(program, config)
    with _LOCK:
        key_lock = _KEY_LOCKS.setdefault(f"default-{key}", threading.Lock())
    with key_lock:
        chosen = _kept_default(key, config)
        if chosen is not None:
            return DefaultKernel(chosen, get_kernel(program, chosen), [])
        first = get_kernel(program, config)
        # (where it spills as well, the fallbacks for spills, in their measured order)
        latency = rejection(config, first) == "latency-bound"
        tried = []
        for candidate in default_candidates(config, latency):
            if tried and tried[-1][0] in _twin(candidate) and not spills(tried[-1][1]):
                continue  # the twin of a kernel that does not spill: nothing to gain
            if tried and not _lowers(program, candidate):
                continue  # a fallback's tile may not fit a segment, or its rings the shared memory
            entry = first if candidate is config else get_kernel(program, candidate)
            tried.append((candidate, entry))
            if rejection(candidate, entry) is None:
                chosen = candidate
                break
        else:  # none without a reason against it: the first that does not spill, else the rules' choice
            chosen, entry = next(((c, e) for c, e in tried if not spills(e)), tried[0])
        _DEFAULTS[key] = chosen
        _write_default(program, config, key, chosen, tried)
    return DefaultKernel(chosen, entry, tried)


def cached_default(program: Program, config: KernelConfig) -> KernelConfig | None:
    """The configuration ``get_default_kernel`` decided for ``config``, from memory or disk, or None
    where it has not been decided (compiles nothing: what ``coda-cute emit`` and ``inspect`` show)."""
    if not _DEFAULTS and not (cache_dir() / "defaults").is_dir():
        return None  # nothing decided anywhere: no key needed (its versions import the DSL, ~1 s)
    config = config.resolved(program)
    return _kept_default(cache_key(program, config), config)


def _lowers(program: Program, config: KernelConfig) -> bool:
    from .lower import lower  # only where a default is decided: a warm load needs no lowering

    try:
        lower(program, config)
        return True
    except UnsupportedError:
        return False


def _kept_default(key: str, config: KernelConfig) -> KernelConfig | None:
    return _kept_choice(_DEFAULTS, "defaults", key, key, default_candidates(config, latency=True))


def _kept_choice(memory: dict, folder: str, record: str, key: str,
                 candidates: list[KernelConfig]) -> KernelConfig | None:
    """The candidate a decision ``record`` (in memory, else ``<root>/<folder>/<record>.json``) names."""
    chosen = memory.get(record)
    if chosen is None:
        root, _ = _open_root()
        chosen = _read_choice(root / folder / f"{record}.json", key, candidates) if root else None
        if chosen is not None:
            memory[record] = chosen
    return chosen


def _choice(config: KernelConfig) -> dict:
    return {"tile": list(config.tile), "cluster": list(config.cluster), "schedule": config.schedule,
            "unroll_subtiles": config.unroll_subtiles}


def _read_choice(path: Path, key: str, candidates: list[KernelConfig]) -> KernelConfig | None:
    """The candidate the record at ``path`` names, if it passes the trust checks and is a record
    of the kernel ``key``, else None."""
    try:
        if not os.path.lexists(path):
            return None
        why = _untrusted(path.parent, want_dir=True) or _untrusted(path, want_dir=False)
        if why:
            _warn_once(f"coda-cute kernel cache: not reading {path.parent.name} record {path.stem[:12]}: {why}")
            return None
        record = json.loads(path.read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    if not isinstance(record, dict) or record.get("key") != key:
        return None
    return next((c for c in candidates if _choice(c) == record.get("chosen")), None)


def _write_default(program: Program, config: KernelConfig, key: str, chosen: KernelConfig,
                   tried: list[tuple[KernelConfig, CacheEntry]]) -> None:
    _write_choice("defaults", key, {
        "key": key,
        "fields": key_fields(program, config),
        "program": program.name,
        "asked": config.describe(),
        "chosen": _choice(chosen),
        "tried": [{"config": short_config(c), "stack_frame_bytes": e.stack_frame_bytes,
                   "local_accesses": e.local_accesses, "instructions": e.instructions} for c, e in tried],
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    })


def _write_choice(folder_name: str, record_name: str, record: dict) -> None:
    """Write a decision record where the root may be written; on failure warn, keep it in memory."""
    root, writable = _open_root()
    if root is None or not writable:
        return
    try:
        folder = _private_subdir(root / folder_name)
        path = folder / f"{record_name}.json"
        if path.is_dir() and not path.is_symlink():  # a stray folder in its place (a link is replaced)
            shutil.rmtree(path)
        handle, staging = tempfile.mkstemp(prefix=f".{record_name[:8]}-", suffix=".json", dir=folder)  # private
        try:
            with os.fdopen(handle, "w") as file:
                file.write(json.dumps(record, indent=1))
            os.replace(staging, path)  # atomic: readers see the whole record or none
        except BaseException:
            Path(staging).unlink(missing_ok=True)
            raise
    except OSError as exc:
        _warn_once(f"coda-cute kernel cache: cannot write {root / folder_name} ({exc.strerror or exc}); "
                   f"{'default configurations' if folder_name == 'defaults' else 'tuning results'} stay in memory")


# ----------------------------------------------------------------------------- autotune
#: seconds of timing per decision, all candidates together (each times at least once; their
#: compiles come before, once, into the cache)
TUNE_BUDGET_S = 2.0
TUNE_ROUNDS = 5  # rounds over the candidates; each candidate's median counts

_TUNED: dict[str, KernelConfig] = {}  # record (cache key of the rules' choice and the shape) -> the winner


def _time_in_rounds(timed: list[tuple[KernelConfig, CacheEntry]], time_kernel) -> dict[KernelConfig, float]:
    """Each candidate's median time over up to TUNE_ROUNDS rounds, every round one call of
    ``time_kernel`` per candidate, starting one candidate later than the round before, so a clock
    that drifts while they are timed weighs on all of them alike; timing stops once TUNE_BUDGET_S
    is spent (the first candidate is always timed)."""
    turns = [timed[(r + i) % len(timed)] for r in range(TUNE_ROUNDS) for i in range(len(timed))]
    samples: dict[KernelConfig, list[float]] = {}
    start = time.perf_counter()
    for candidate, entry in turns:
        if samples and time.perf_counter() - start > TUNE_BUDGET_S:
            break
        samples.setdefault(candidate, []).append(float(time_kernel(candidate, entry)))
    import statistics  # here: a warm load, which never tunes, does not pay for its import

    return {c: statistics.median(v) for c, v in samples.items()}


def tune_candidates(config: KernelConfig) -> list[KernelConfig]:
    """``config`` (the runtime's rules' choice), then its arch's ``Backend.tune_shapes`` with every
    other field of it."""
    out = [config]
    for tile, cluster, schedule in backend(config.arch).tune_shapes:
        candidate = reshaped(config, tile, schedule, cluster)
        if candidate not in out:
            out.append(candidate)
    return out


@dataclass
class TunedKernel:
    """What ``get_tuned_kernel`` found: the configuration calls run, its kernel, and the
    candidates' times in ms (empty where the decision was kept from before)."""

    config: KernelConfig
    entry: CacheEntry
    times: dict[KernelConfig, float]


def get_tuned_kernel(program: Program, config: KernelConfig, shape: tuple[int, int, int],
                     time_kernel: Callable[[KernelConfig, CacheEntry], float]) -> TunedKernel:
    """The fastest kernel for problems of ``shape`` (M, N, K) among ``tune_candidates(config)``,
    as ``time_kernel(candidate, its CacheEntry)`` (ms, on the caller's GPU and tensors) measures it.

    Candidates the generator cannot build are skipped; a ping-pong one that spills is replaced by
    its twin where that does not (``default_candidates``); those that spill are timed only if
    every one does.  Timing stops after TUNE_BUDGET_S.  The winner is kept in memory and beside the
    kernels (``<root>/tuned/<key>-<M>x<N>x<K>.json``, key: the rules' choice's ``cache_key``,
    written and trusted like a default's record), so a later process starts with it."""
    config = config.resolved(program)
    key = cache_key(program, config)
    record = f"{key}-{'x'.join(str(int(x)) for x in shape)}"
    candidates = tune_candidates(config)
    with _LOCK:
        key_lock = _KEY_LOCKS.setdefault(f"tuned-{record}", threading.Lock())
    with key_lock:
        chosen = _kept_choice(_TUNED, "tuned", record, key, _with_twins(candidates))
        if chosen is not None:
            return TunedKernel(chosen, get_kernel(program, chosen), {})
        built = []
        for candidate in candidates:
            if candidate is config or _lowers(program, candidate):
                entry = get_kernel(program, candidate)
                for twin in _twin(candidate) if spills(entry) else ():
                    twin_entry = get_kernel(program, twin)  # a ping-pong kernel may not spill the other way
                    if not spills(twin_entry):
                        candidate, entry = twin, twin_entry
                built.append((candidate, entry))
        timed = [(c, e) for c, e in built if not spills(e)] or built
        times = _time_in_rounds(timed, time_kernel)
        chosen = min(times, key=times.get)
        _TUNED[record] = chosen
        _write_choice("tuned", record, {
            "key": key, "shape": list(shape), "program": program.name, "asked": config.describe(),
            "chosen": _choice(chosen),
            "ms": {short_config(c): round(ms, 5) for c, ms in times.items()},
            "spilling": [short_config(c) for c, e in built if e.stack_frame_bytes],
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        })
    return TunedKernel(chosen, dict(built)[chosen], times)


# ----------------------------------------------------------------------------- listing
def list_entries() -> list[dict]:
    """Manifests of the disk cache's entries (for `coda-cute cache ls`), every field a plain
    value: a manifest that cannot be read lists as "corrupted manifest"."""
    root = cache_dir()
    found = []
    for manifest in sorted(root.glob("*/*/manifest.json")) if root.is_dir() else []:
        try:
            data = json.loads(manifest.read_text())
        except (OSError, ValueError, UnicodeDecodeError):
            data = None
        if not isinstance(data, dict):
            data = {"config": "corrupted manifest"}
        seconds = data.get("compile_seconds")
        found.append({
            "key": str(data.get("key", manifest.parent.name)), "program": str(data.get("program", "?")),
            "config": str(data.get("config", "?")), "created": str(data.get("created", "?")),
            "compile_seconds": seconds if isinstance(seconds, (int, float)) and not isinstance(seconds, bool) else None,
            "path": str(manifest.parent),
            "bytes": sum(p.stat().st_size for p in manifest.parent.iterdir() if p.is_file()),
        })
    return found


def clear() -> int:
    """Remove every disk entry and default record (and what interrupted writes left); returns how
    many entries were removed.  Memory entries stay loaded."""
    root = cache_dir()
    if not root.is_dir():
        return 0
    removed = 0
    for shard in root.iterdir():
        if shard.name in ("locks", "defaults") or not shard.is_dir() or shard.is_symlink():
            continue
        for item in shard.iterdir():
            removed += (item / "manifest.json").exists() and not item.name.startswith(".")
            if item.is_dir() and not item.is_symlink():
                shutil.rmtree(item, ignore_errors=True)
            else:
                item.unlink(missing_ok=True)
    for name in ("locks", "defaults"):
        shutil.rmtree(root / name, ignore_errors=True)
    return removed


# ----------------------------------------------------------------------------- naming
def short_config(config: KernelConfig) -> str:
    """One compact line for progress output: dtype, majors, tile, cluster, GPU, operand dtypes."""
    text = (f"{config.dtype} {config.majors} tile {config.tile[0]}x{config.tile[1]} "
            f"cluster {config.cluster[0]}x{config.cluster[1]} {config.schedule} {config.gpu}")
    odd = [f"{name}={dtype}" for name, dtype in config.operand_dtypes if dtype != config.dtype]
    return text + (" unrolled" if config.unroll_subtiles else "") + (f" ({', '.join(odd)})" if odd else "")

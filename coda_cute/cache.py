"""The kernel cache: in memory, and on disk across processes.

Key = sha256 of everything that can change the compiled kernel (``key_fields``):
program fingerprint, kernel config (arch, GPU, dtypes, majors, tile, cluster), the
template and generator sources, and the CuTe DSL / TVM-FFI versions and library flavor.
Anything missing from that list would let a stale kernel be loaded, so it fails closed:
if a version cannot be read, the key says "unknown" and nothing old matches it.

Disk layout (``cache_dir()``, private to the user, mode 0700):

    <root>/<key[:2]>/<key>/kernel.o        exported object (TVM-FFI), loaded with load_module
                          kernel.py        the emitted source it was compiled from
                          manifest.json    key fields, versions, compile time, sha256 of kernel.o
    <root>/locks/<key>.lock                held while one process compiles that key

An entry is written into a temporary folder and renamed into place, so readers see a
whole entry or none; a manifest whose checksum does not match its object is rebuilt.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from .config import KernelConfig
from .program import Program

ENV_DIR = "CODA_CUTE_CACHE_DIR"
ENV_DISABLE = "CODA_CUTE_NO_DISK_CACHE"
_GENERATOR_FILES = ("program.py", "lower.py", "render.py", "compile.py", "config.py", "cache.py")


@dataclass
class CacheEntry:
    key: str
    function: object  # TVM-FFI callable taking torch tensors
    source: str
    origin: str  # "compiled", "disk" or "memory"
    path: Path | None
    seconds: float  # compile or load time


_MEMORY: dict[str, CacheEntry] = {}
_LOCK = threading.Lock()


def cache_dir() -> Path:
    """$CODA_CUTE_CACHE_DIR, else $XDG_CACHE_HOME/coda-cute, else ~/.cache/coda-cute."""
    root = os.environ.get(ENV_DIR)
    if not root:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(base, "coda-cute")
    return Path(root)


def _private_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path, 0o700)  # native code is loaded from here: nobody else may write it
    return path


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
    try:
        import tvm_ffi

        fields["tvm_ffi"] = tvm_ffi.__version__
    except Exception:
        fields["tvm_ffi"] = f"unknown-{time.time_ns()}"
    here = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for name in _GENERATOR_FILES:
        digest.update((here / name).read_bytes())
    from .library import resource_dir

    for template in sorted(resource_dir("templates").glob("*.j2")):
        digest.update(template.read_bytes())
    fields["generator"] = digest.hexdigest()
    return fields


def key_fields(program: Program, config: KernelConfig) -> dict:
    config = config.resolved(program)
    return {"program": program.fingerprint, "config": list(map(_jsonable, config.key())), **environment_fields()}


def cache_key(program: Program, config: KernelConfig) -> str:
    return hashlib.sha256(json.dumps(key_fields(program, config), sort_keys=True).encode()).hexdigest()


def _jsonable(value):
    return [_jsonable(v) for v in value] if isinstance(value, (tuple, list)) else value


def get_kernel(program: Program, config: KernelConfig) -> CacheEntry:
    """The compiled kernel for (program, config): from memory, disk, or a fresh compile."""
    config = config.resolved(program)
    key = cache_key(program, config)
    with _LOCK:
        entry = _MEMORY.get(key)
        if entry is not None:
            return entry
        entry = _load_or_compile(program, config, key)
        _MEMORY[key] = entry
        return entry


def _load_or_compile(program: Program, config: KernelConfig, key: str) -> CacheEntry:
    if os.environ.get(ENV_DISABLE):
        return _compile(program, config, key, None)
    folder = _private_dir(cache_dir()) / key[:2] / key
    entry = _load(folder, key)
    if entry is not None:
        return entry
    lock_path = _private_dir(cache_dir() / "locks") / f"{key}.lock"
    with open(lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one process compiles a key; the others wait, then load
        try:
            entry = _load(folder, key)
            if entry is None:
                entry = _compile(program, config, key, folder)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return entry


def _load(folder: Path, key: str) -> CacheEntry | None:
    manifest_path, obj = folder / "manifest.json", folder / "kernel.o"
    if not manifest_path.exists():
        return None
    try:
        manifest = json.loads(manifest_path.read_text())
        if manifest.get("key") != key or _sha256(obj) != manifest.get("object_sha256"):
            raise ValueError("checksum mismatch")
        start = time.perf_counter()
        from cutlass.cute.runtime import load_module

        function = load_module(str(obj), enable_tvm_ffi=True)["func"]
        source = (folder / "kernel.py").read_text()
        return CacheEntry(key, function, source, "disk", folder, time.perf_counter() - start)
    except Exception:
        shutil.rmtree(folder, ignore_errors=True)  # truncated or corrupted: rebuild, never load
        return None


def _compile(program: Program, config: KernelConfig, key: str, folder: Path | None) -> CacheEntry:
    from .compile import compile_program

    compiled = compile_program(program, config, tvm_ffi=True)
    entry = CacheEntry(key, compiled.function, compiled.source, "compiled", folder, compiled.compile_seconds)
    if folder is None:
        return entry
    _private_dir(folder.parent)
    staging = Path(tempfile.mkdtemp(prefix=f".{key[:8]}-", dir=folder.parent))
    try:
        compiled.function.export_to_c(object_file_path=str(staging / "kernel.o"), function_name="func")
        (staging / "kernel.py").write_text(compiled.source)
        manifest = {
            "key": key,
            "fields": key_fields(program, config),
            "program": program.name,
            "config": config.describe(),
            "compile_seconds": round(compiled.compile_seconds, 3),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "object_sha256": _sha256(staging / "kernel.o"),
        }
        (staging / "manifest.json").write_text(json.dumps(manifest, indent=1))
        os.rename(staging, folder)  # atomic: readers see the whole entry or none
        entry.path = folder
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not (folder / "manifest.json").exists():
            raise
    return entry


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else ""


def list_entries() -> list[dict]:
    """Manifests of the disk cache's entries (for `coda-cute cache ls`)."""
    root = cache_dir()
    found = []
    for manifest in sorted(root.glob("*/*/manifest.json")):
        try:
            data = json.loads(manifest.read_text())
        except (OSError, ValueError):
            data = {"key": manifest.parent.name, "program": "?", "config": "corrupted manifest"}
        data["path"] = str(manifest.parent)
        data["bytes"] = sum(p.stat().st_size for p in manifest.parent.iterdir())
        found.append(data)
    return found


def clear() -> int:
    """Remove every disk entry; returns how many were removed.  Memory entries stay loaded."""
    entries = list_entries()
    for entry in entries:
        shutil.rmtree(entry["path"], ignore_errors=True)
    shutil.rmtree(cache_dir() / "locks", ignore_errors=True)
    return len(entries)

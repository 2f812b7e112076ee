"""The kernel cache on a CPU-only machine: keys, the private directory, atomic entries,
concurrent compiles of one key, and corrupted entries (kernels cross-compile for sm_90a and
their TVM-FFI objects load without a GPU)."""

import json
import multiprocessing as mp
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from coda_cute import cache, library
from coda_cute.config import KernelConfig

pytestmark = pytest.mark.compile
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(cache.ENV_DIR, str(tmp_path / "cache"))
    monkeypatch.delenv(cache.ENV_DISABLE, raising=False)
    cache._MEMORY.clear()
    yield tmp_path / "cache"
    cache._MEMORY.clear()


def test_key_is_stable_across_processes():
    code = ("from coda_cute import cache, library; from coda_cute.config import KernelConfig; "
            "print(cache.cache_key(library.get('swiglu'), KernelConfig()))")
    keys = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout.strip() for seed in ("1", "2")}
    assert keys == {cache.cache_key(library.get("swiglu"), KernelConfig())}


def test_key_changes_with_everything_that_changes_the_kernel(monkeypatch):
    program, config = library.get("bias_gelu"), KernelConfig()
    base = cache.cache_key(program, config)
    variants = [
        cache.cache_key(library.get("gemm"), config),
        cache.cache_key(library.get("rms_scale"), config),
        cache.cache_key(program, config.with_(dtype="f16")),
        cache.cache_key(program, config.with_(operand_dtypes=(("bias", "f32"),))),
        cache.cache_key(program, config.with_(majors="mk")),
        cache.cache_key(program, config.with_(tile=(128, 128))),
        cache.cache_key(program, config.with_(cluster=(1, 1))),
        cache.cache_key(program, config.with_(gpu="H100-PCIe")),
        cache.cache_key(program, config.with_(tile=(64, 256), schedule="pingpong")),
    ]
    assert len(set(variants + [base])) == len(variants) + 1
    # the same kernel spelled two ways has one key (bias_gelu has no reductions to finish)
    assert cache.cache_key(program, config.with_(operand_dtypes=(("bias", "bf16"),))) == base
    assert cache.cache_key(program, config.with_(finish_in_gemm=True)) == base
    reducing = library.get("residual_sumsq")
    assert cache.cache_key(reducing, config.with_(finish_in_gemm=True)) != cache.cache_key(reducing, config)
    # the DSL version, the template and the generator sources are part of it
    for field, value in (("cutlass_dsl", "9.9.9"), ("dsl_flavor", "cu99"), ("generator", "0" * 64)):
        fields = dict(cache.environment_fields())
        fields[field] = value
        monkeypatch.setattr(cache, "environment_fields", lambda fields=fields: fields)
        assert cache.cache_key(program, config) != base, field
        monkeypatch.undo()


def test_template_change_changes_the_generator_hash(tmp_path, monkeypatch):
    from coda_cute import library as lib

    before = cache.environment_fields()["generator"]
    copy = tmp_path / "templates"
    copy.mkdir()
    for template in lib.resource_dir("templates").glob("*.j2"):
        (copy / template.name).write_text(template.read_text() + "\n# changed\n")
    shipped = lib.resource_dir
    monkeypatch.setattr(lib, "resource_dir", lambda name: copy if name == "templates" else shipped(name))
    cache.environment_fields.cache_clear()
    try:
        assert cache.environment_fields()["generator"] != before
    finally:
        cache.environment_fields.cache_clear()


def test_warm_process_traces_one_library_module_and_keys_without_importing_tvm_ffi():
    """Before a warm process loads its kernel: library.get traces only the module that defines
    the program, and the cache key reads tvm_ffi's version from its installed metadata (the
    module's own import, 20-40 ms, is the load's, not the key's)."""
    code = ("import sys; from coda_cute import library; from coda_cute.cache import cache_key; "
            "from coda_cute.config import KernelConfig; cache_key(library.get('swiglu_bwd'), KernelConfig()); "
            "print(sorted(m for m in sys.modules if m.startswith('coda_cute.epilogues.')), 'tvm_ffi' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[-2] == "['coda_cute.epilogues.mlp'] False", done.stdout


def test_library_lookup_of_one_module_finds_what_the_whole_library_holds():
    """library.get before the whole library is loaded (one module at a time) gives each
    program, the very object programs() then lists under its name."""
    names = list(library.programs())
    code = ("import sys; from coda_cute import library; names = sys.argv[1:]; got = [library.get(n) for n in names]; "
            "print(all(g is library.programs()[n] for g, n in zip(got, names)))")
    done = subprocess.run([sys.executable, "-c", code, *names], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.split("\n")[-2] == "True", done.stdout + done.stderr[-2000:]


def test_entry_is_private_whole_and_reloaded(cache_dir):
    program, config = library.get("gemm"), KernelConfig()
    entry = cache.get_kernel(program, config)
    assert entry.origin == "compiled" and entry.path.is_dir()
    assert stat.S_IMODE(os.stat(cache_dir).st_mode) == 0o700
    assert sorted(p.name for p in entry.path.iterdir()) == ["kernel.o", "kernel.py", "manifest.json"]
    manifest = json.loads((entry.path / "manifest.json").read_text())
    assert manifest["key"] == entry.key and manifest["fields"]["program"] == program.fingerprint
    from coda_cute.render import emit

    assert (entry.path / "kernel.py").read_text() == emit(program, config), "the cached source is what emit shows"
    assert cache.get_kernel(program, config) is entry  # memory
    cache._MEMORY.clear()
    again = cache.get_kernel(program, config)
    assert again.origin == "disk" and again.key == entry.key
    # a fresh process loads it without what only compiling needs (the file lock, the lowering):
    # importing those would be most of a warm load's time outside the DSL
    code = ("import sys; from coda_cute import cache, library; from coda_cute.config import KernelConfig; "
            "e = cache.get_kernel(library.get('gemm'), KernelConfig()); "
            "print(e.origin, *(m in sys.modules for m in ('filelock', 'coda_cute.lower', 'coda_cute.render')))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert loaded.stdout.split() == ["disk", "False", "False", "False"], loaded.stderr[-2000:]


@pytest.mark.parametrize("damage", ["truncate", "flip", "manifest"])
def test_corrupted_entry_is_rebuilt_not_loaded(cache_dir, damage):
    program, config = library.get("gemm"), KernelConfig()
    entry = cache.get_kernel(program, config)
    obj = entry.path / "kernel.o"
    data = obj.read_bytes()
    if damage == "truncate":
        obj.write_bytes(data[: len(data) // 3])
    elif damage == "flip":
        obj.write_bytes(data[:100] + bytes([data[100] ^ 0xFF]) + data[101:])
    else:
        (entry.path / "manifest.json").write_text("{not json")
    cache._MEMORY.clear()
    rebuilt = cache.get_kernel(program, config)
    assert rebuilt.origin == "compiled"
    assert (entry.path / "kernel.o").read_bytes() != b"" and json.loads((entry.path / "manifest.json").read_text())


def _racer(cache_root, barrier, rounds, results):
    os.environ[cache.ENV_DIR] = cache_root
    from coda_cute import cache as c
    from coda_cute import library as lib
    from coda_cute.config import KernelConfig as Config

    for _ in range(rounds):
        barrier.wait()  # the parent has removed the entry
        c._MEMORY.clear()
        entry = c.get_kernel(lib.get("gemm"), Config())
        results.put(entry.origin)
        barrier.wait()


def test_two_processes_racing_on_one_key_leave_one_valid_entry(cache_dir):
    rounds = 10  # each round compiles gemm once (~1.5 s here); 20 took 38 s of the CPU suite
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(3), ctx.Queue()
    workers = [ctx.Process(target=_racer, args=(str(cache_dir), barrier, rounds, results)) for _ in range(2)]
    for w in workers:
        w.start()
    try:
        key = cache.cache_key(library.get("gemm"), KernelConfig())
        folder = cache_dir / key[:2] / key
        for _ in range(rounds):
            import shutil

            shutil.rmtree(folder, ignore_errors=True)
            barrier.wait(timeout=120)  # release both racers at once
            barrier.wait(timeout=120)  # both done
            origins = sorted(results.get(timeout=10) for _ in range(2))
            assert origins == ["compiled", "disk"], origins  # one compiled, the other loaded its entry
            entries = [p for p in folder.parent.iterdir()]
            assert entries == [folder], f"leftovers next to the entry: {entries}"
            manifest = json.loads((folder / "manifest.json").read_text())
            assert manifest["object_sha256"] == cache._sha256(folder / "kernel.o")
    finally:
        for w in workers:
            w.join(timeout=60)
            if w.is_alive():
                w.kill()
    assert all(w.exitcode == 0 for w in workers)


# --------------------------------------------------------------------------- what is trusted
def _cached_gemm(cache_dir):
    """A valid disk entry for gemm (compiled once per test), and the (program, config) behind it."""
    program, config = library.get("gemm"), KernelConfig()
    entry = cache.get_kernel(program, config)
    assert entry.origin in ("compiled", "disk") and entry.path is not None
    cache._MEMORY.clear()
    return program, config, entry.path


def _fresh_get(program, config):
    cache._MEMORY.clear()
    cache._WARNED.clear()
    with pytest.warns(cache.CacheWarning) as caught:
        entry = cache.get_kernel(program, config)
    return entry, " ".join(str(w.message) for w in caught)


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
def test_a_root_owned_by_another_user_is_never_used(cache_dir):
    program, config, folder = _cached_gemm(cache_dir)
    planted = folder / "kernel.o"
    before = planted.read_bytes()
    for path in [cache_dir, *cache_dir.rglob("*")]:
        os.chown(path, 12345, 12345)  # another user's cache, entry and checksums all consistent
    entry, said = _fresh_get(program, config)
    assert entry.origin == "compiled" and entry.path is None, "nothing loaded from a foreign folder"
    assert "belongs to uid 12345" in said and planted.read_bytes() == before, "and nothing written there"


def test_a_root_writable_by_others_is_never_used(cache_dir):
    program, config, _ = _cached_gemm(cache_dir)
    os.chmod(cache_dir, 0o777)
    entry, said = _fresh_get(program, config)
    assert entry.origin == "compiled" and entry.path is None and "writable by group" in said


@pytest.mark.parametrize("damage", ["group-writable object", "foreign source", "linked entry", "edited source"])
def test_an_entry_that_fails_a_check_is_rebuilt_not_loaded(cache_dir, damage):
    program, config, folder = _cached_gemm(cache_dir)
    if damage == "group-writable object":
        os.chmod(folder / "kernel.o", 0o660)
    elif damage == "foreign source":
        if os.geteuid() != 0:
            pytest.skip("chown to another uid needs root")
        os.chown(folder / "kernel.py", 12345, 12345)
    elif damage == "linked entry":
        moved = folder.with_name("elsewhere")
        folder.rename(moved)
        folder.symlink_to(moved)
    else:  # the source a user reads back (`.source`) is covered by the manifest too
        (folder / "kernel.py").write_text((folder / "kernel.py").read_text() + "# edited\n")
    cache._MEMORY.clear()
    entry = cache.get_kernel(program, config)
    assert entry.origin == "compiled" and entry.path == folder and not folder.is_symlink()
    cache._MEMORY.clear()
    assert cache.get_kernel(program, config).origin == "disk", "the rebuilt entry passes every check"


@pytest.mark.parametrize("broken", ["no manifest", "file at entry path", "stale staging folder", "file at shard"])
def test_broken_entries_of_every_kind_are_rebuilt(cache_dir, broken):
    program, config, folder = _cached_gemm(cache_dir)
    shard = folder.parent
    if broken == "no manifest":  # e.g. an interrupted `cache clear`
        (folder / "manifest.json").unlink()
    elif broken == "file at entry path":
        shutil.rmtree(folder)
        folder.write_text("not a folder")
    elif broken == "stale staging folder":  # a write killed before its rename
        shutil.rmtree(folder)
        (shard / f".{folder.name[:8]}-dead").mkdir()
    else:
        shutil.rmtree(shard)
        shard.write_text("not a folder")
    for _ in range(2):  # rebuilt once, then served from disk
        cache._MEMORY.clear()
        entry = cache.get_kernel(program, config)
        assert entry.path == folder
    assert entry.origin == "disk" and sorted(p.name for p in shard.iterdir()) == [folder.name]


def test_a_read_only_cache_is_used_read_only(cache_dir):
    program, config, folder = _cached_gemm(cache_dir)
    os.chmod(cache_dir, 0o500)  # the user's own folder, made read-only on purpose
    try:
        cache._WARNED.clear()
        with pytest.warns(cache.CacheWarning, match="read-only"):
            assert cache.get_kernel(program, config).origin == "disk", "its kernels load"
            other = cache.get_kernel(library.get("bias_gelu"), config)
        assert other.origin == "compiled" and other.path is None, "new ones stay in memory"
        assert stat.S_IMODE(os.stat(cache_dir).st_mode) == 0o500, "and the folder is left as it was"
        assert sorted(p.name for p in cache_dir.iterdir()) == sorted([folder.parent.name, "locks"])
    finally:
        os.chmod(cache_dir, 0o700)


@pytest.mark.skipif(os.geteuid() != 0, reason="a cache owned by root needs root to make")
def test_a_shared_cache_prepared_by_root_loads_for_other_users(cache_dir, monkeypatch):
    program, config, folder = _cached_gemm(cache_dir)
    for path in [cache_dir, *cache_dir.rglob("*")]:
        os.chmod(path, 0o755 if path.is_dir() else 0o644)  # what an administrator hands out
    monkeypatch.setattr(cache.os, "geteuid", lambda: 65534)  # seen by another user
    cache._WARNED.clear()
    with pytest.warns(cache.CacheWarning, match="read-only for you"):
        assert cache.get_kernel(program, config).origin == "disk"
        other = cache.get_kernel(library.get("bias_gelu"), config)
    assert other.origin == "compiled" and other.path is None
    assert sorted(p.name for p in cache_dir.iterdir()) == sorted([folder.parent.name, "locks"])


def test_a_cache_that_cannot_be_written_never_fails_a_call(cache_dir, monkeypatch):
    import errno

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(cache.os, "rename", full_disk)
    cache._WARNED.clear()
    with pytest.warns(cache.CacheWarning, match="No space left on device"):
        entry = cache.get_kernel(library.get("gemm"), KernelConfig())
    assert entry.origin == "compiled" and entry.path is None
    assert cache.get_kernel(library.get("gemm"), KernelConfig()) is entry, "kept in memory: no second compile"
    assert not [p for p in cache_dir.rglob(".*") if p.is_dir()], "no staging folder left behind"


def test_a_lock_held_too_long_is_waited_for_then_skipped(cache_dir, monkeypatch):
    import filelock

    program, config = library.get("gemm"), KernelConfig()
    key = cache.cache_key(program, config)
    (cache_dir / "locks").mkdir(parents=True, mode=0o700)
    os.chmod(cache_dir, 0o700)
    held = filelock.FileLock(str(cache_dir / "locks" / f"{key}.lock"))
    held.acquire()  # a stuck process
    try:
        monkeypatch.setattr(cache, "LOCK_TIMEOUT", 0.2)
        cache._WARNED.clear()
        with pytest.warns(cache.CacheWarning, match="compiling here too"):
            entry = cache.get_kernel(program, config)
        assert entry.origin == "compiled" and entry.path is not None
    finally:
        held.release()


def test_cache_ls_and_clear_survive_malformed_manifests(cache_dir):
    _, _, folder = _cached_gemm(cache_dir)
    other = folder.parent / ("0" * 64)
    other.mkdir()
    (other / "manifest.json").write_text("[1, 2]")
    entries = cache.list_entries()
    assert sorted(e["config"] for e in entries)[0] == "corrupted manifest" and len(entries) == 2
    assert all(isinstance(e[k], str) for e in entries for k in ("key", "program", "config", "created"))
    assert cache.clear() == 2 and cache.list_entries() == []

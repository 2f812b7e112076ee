"""The kernel cache on a CPU-only machine: keys, the private directory, atomic entries,
concurrent compiles of one key, and corrupted entries (kernels cross-compile for sm_90a and
their TVM-FFI objects load without a GPU)."""

import json
import multiprocessing as mp
import os
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
    # the same kernel spelled two ways has one key
    assert cache.cache_key(program, config.with_(operand_dtypes=(("bias", "bf16"),))) == base
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
    monkeypatch.setattr(lib, "resource_dir", lambda name: copy if name == "templates" else lib.resource_dir(name))
    cache.environment_fields.cache_clear()
    try:
        assert cache.environment_fields()["generator"] != before
    finally:
        cache.environment_fields.cache_clear()


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

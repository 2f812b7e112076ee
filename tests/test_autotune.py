"""Kernel(program, autotune=True): the candidates of cache.tune_candidates are built, those that do
not spill are timed (cache.get_tuned_kernel), the fastest runs, and the choice is kept in memory
and beside the kernels, so a later process starts with it.  On the CPU the timings are stand-ins;
the GPU test times real kernels."""

import json

import pytest
import torch

from coda_cute import cache
from coda_cute.backends.registry import backend
from coda_cute.config import KernelConfig
from coda_cute.errors import UnsupportedError
from coda_cute.runtime import Kernel

from test_default_config import cache_dir, geglu_save, rules_choice  # noqa: F401 - the fixture

SHAPE = (8192, 4096, 4096)


def test_candidates_start_with_the_rules_choice_and_keep_its_other_fields():
    rules = KernelConfig(tile=(128, 192), cluster=(1, 2), schedule="pingpong", ab_stages=3)
    shapes = backend("sm_90a").tune_shapes
    candidates = cache.tune_candidates(rules)
    assert candidates[0] is rules and len(candidates) == len(set(candidates)) == 1 + len(shapes) - 1
    assert {(c.tile, c.cluster, c.schedule) for c in candidates[1:]} | {((128, 192), (1, 2), "pingpong")} == \
        {tuple(t) for t in shapes}
    assert {c.ab_stages for c in candidates} == {3}


def test_sm100a_candidates_are_the_shapes_it_builds():
    """Blackwell tunes over its own shapes (CTA pairs, multicast clusters), each one it can build."""
    rules = KernelConfig(arch="sm_100a", gpu="B200", tile=(128, 256), cluster=(1, 1), schedule="cooperative")
    candidates = cache.tune_candidates(rules)
    assert {(c.tile, c.cluster) for c in candidates} >= {((256, 256), (2, 1)), ((128, 256), (1, 2))}
    for c in candidates:
        c.check()
        assert c.arch == "sm_100a" and c.schedule == "cooperative"


@pytest.mark.compile
def test_the_fastest_kernel_that_does_not_spill_runs_and_is_remembered(cache_dir, monkeypatch):  # noqa: F811
    rules = rules_choice(geglu_save)
    timed = []
    fake_ms = {c: 1.0 + 0.1 * i for i, c in enumerate(cache.tune_candidates(rules))}

    def time_kernel(config, entry):
        assert not entry.stack_frame_bytes, f"a spilling candidate was timed: {config.describe()}"
        timed.append(config)
        return fake_ms[config]

    tuned = cache.get_tuned_kernel(geglu_save, rules, SHAPE, time_kernel)
    fastest_clean = min(timed, key=fake_ms.get)
    assert rules not in timed, "geglu_save no longer spills at its rules' choice: find another program"
    assert tuned.config == fastest_clean and set(tuned.times) == set(timed)
    record_path = next((cache_dir / "tuned").glob("*.json"))
    record = json.loads(record_path.read_text())
    assert record_path.stem == f"{cache.cache_key(geglu_save, rules)}-8192x4096x4096"
    assert record["chosen"] == {"tile": list(tuned.config.tile), "cluster": list(tuned.config.cluster),
                                "schedule": tuned.config.schedule, "unroll_subtiles": tuned.config.unroll_subtiles}
    assert cache.short_config(rules) in record["spilling"] and len(record["ms"]) == len(set(timed))
    assert oct(record_path.stat().st_mode & 0o777) == oct(0o600)

    # another shape is its own decision; a fresh start reads this one, timing and compiling nothing
    cache._MEMORY.clear()
    cache._TUNED.clear()
    monkeypatch.setattr(cache, "_compile", lambda *args: pytest.fail("compiled with the decision on disk"))
    again = cache.get_tuned_kernel(geglu_save, rules, SHAPE, lambda *a: pytest.fail("timed again"))
    assert again.config == tuned.config and again.times == {} and again.entry.origin == "disk"

    # a record naming something that is not a candidate is not trusted
    record_path.write_text(json.dumps({**record, "chosen": {"tile": [64, 64], "cluster": [1, 1],
                                                            "schedule": "cooperative"}}))
    cache._TUNED.clear()
    monkeypatch.undo()
    monkeypatch.setenv(cache.ENV_DIR, str(cache_dir))
    retimed = cache.get_tuned_kernel(geglu_save, rules, SHAPE, time_kernel)
    assert retimed.times and retimed.config == fastest_clean


@pytest.mark.compile
def test_timing_stops_at_the_budget_after_one_candidate(cache_dir, monkeypatch):  # noqa: F811
    from coda_cute import library

    program = library.get("gemm")
    rules = rules_choice(program)
    monkeypatch.setattr(cache, "TUNE_BUDGET_S", 0.0)
    timed = []
    tuned = cache.get_tuned_kernel(program, rules, (256, 256, 64), lambda c, e: timed.append(c) or 1.0)
    assert timed == [rules] and tuned.config == rules


def test_autotune_takes_no_fixed_tile_and_leaves_cpu_calls_alone(gen):
    with pytest.raises(UnsupportedError, match="leave them unset"):
        Kernel(geglu_save, autotune=True, tile=(128, 128))
    with pytest.raises(UnsupportedError, match="leave them unset"):
        Kernel(geglu_save, autotune=True, unroll_subtiles=False)
    with pytest.raises(UnsupportedError, match="autotune True or False"):
        Kernel(geglu_save, autotune="yes")
    a, b = torch.randn(16, 64, generator=gen).bfloat16(), torch.randn(32, 64, generator=gen).bfloat16()
    out = Kernel(geglu_save, autotune=True)(a, b)
    assert out["D"].shape == (16, 16) and out["preact"].shape == (16, 32)


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
def test_autotuned_kernel_is_correct_and_its_choice_is_kept(cache_dir, gen):  # noqa: F811
    from coda_cute.reference import evaluate

    m, n, k = 1000, 512, 256
    a = (torch.randn(m, k, generator=gen) / k ** 0.25).bfloat16().cuda()
    b = (torch.randn(2 * n, k, generator=gen) / k ** 0.25).bfloat16().cuda()
    kernel = Kernel(geglu_save, autotune=True)
    out = kernel(a, b)
    want = evaluate(geglu_save, a.float().cpu(), b.float().cpu()).outputs
    for name in ("D", "preact"):
        err = (out[name].float().cpu() - want[name]).norm() / want[name].norm()
        assert err < 1e-2, name
    assert kernel.last.path == "kernel" and kernel.launches == 1
    ran = kernel.last.config
    rules = rules_choice(geglu_save)
    assert (ran.tile, ran.cluster, ran.schedule) in {(rules.tile, rules.cluster, rules.schedule),
                                                     *backend(ran.arch).tune_shapes}
    assert len(list((cache_dir / "tuned").glob(f"*-{m}x{2 * n}x{k}.json"))) == 1


def test_cli_tune_needs_a_gpu_and_a_shape(capsys):
    from coda_cute.cli import main

    assert main(["tune", "gemm", "--shape", "256x0x64"]) == 2
    assert "--shape must be MxNxK" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["tune", "gemm", "--shape", "256x256x64"]) == 2
        assert "has none" in capsys.readouterr().err


def test_candidates_are_timed_in_rounds_and_their_medians_compared(monkeypatch):
    """A clock that drifts while candidates are timed in turn must not pick the winner: each round
    starts one candidate later, and a candidate's median over the rounds counts."""
    entries = [(f"c{i}", None) for i in range(3)]
    calls = []
    drift = iter(range(100))

    def time_kernel(config, entry):
        calls.append(config)
        # c1 is 10 % faster than the others, under a clock that slows by 5 % a call
        return (0.9 if config == "c1" else 1.0) * (1.0 + 0.05 * next(drift))
    monkeypatch.setattr(cache, "TUNE_BUDGET_S", 1e9)
    times = cache._time_in_rounds(entries, time_kernel)
    assert calls[:6] == ["c0", "c1", "c2", "c1", "c2", "c0"] and len(calls) == 3 * cache.TUNE_ROUNDS
    assert min(times, key=times.get) == "c1"

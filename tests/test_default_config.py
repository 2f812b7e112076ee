"""The configuration a call runs when it fixes none of tile, cluster and schedule never spills
registers where a candidate does not (cache.get_default_kernel; a few values parked once per
tile, SPILL_TOLERATED_ACCESSES, are no spill), and the decision is kept in memory and beside the
kernels on disk, so a later process goes straight to it.  Kernels cross-compile for sm_90a on
this CPU-only machine; spills are read from their cubins."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import coda_cute as cc
from coda_cute import cache, library
from coda_cute.arguments import bind
from coda_cute.cache import LATENCY_BOUND, SPILL_TOLERATED_ACCESSES, default_candidates, latency_bound, spills
from coda_cute.cli import main
from coda_cute.compile import CompiledKernel, kernel_instructions, local_accesses, stack_frame_bytes
from coda_cute.config import KernelConfig, unrolled_subtiles
from coda_cute.precompile import PrecompileResult
from coda_cute.runtime import Kernel, SpillWarning, fill_config

sys.path.insert(0, str(Path(__file__).parent))
from random_programs import random_program  # noqa: E402

pytestmark = pytest.mark.compile
ROOT = Path(__file__).resolve().parent.parent


@cc.epilogue
def geglu_save(acc):
    """A GLU with erf GELU and its saved pre-activation: heavy by the rules (N/2 + N columns
    stored), so ping-pong 128x192 up to K = 2048, where it spills."""
    gate, up = cc.pairs(acc)
    return {"D": cc.gelu(gate) * up, "preact": acc}


def rules_choice(program, k: int = 2048) -> KernelConfig:
    """The runtime's choice for a large problem, 8192 x 8192 x k (not host-bound): at K = 2048
    every heavy epilogue runs ping-pong 128x192 (runtime._pingpong_max_k)."""
    tile, cluster, schedule = fill_config(program, 8192, 8192, k=k)
    return KernelConfig(tile=tile, cluster=cluster, schedule=schedule,
                        unroll_subtiles=unrolled_subtiles(schedule, "sm_90a")).resolved(program)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(cache.ENV_DIR, str(tmp_path / "cache"))
    monkeypatch.delenv(cache.ENV_DISABLE, raising=False)
    cache._MEMORY.clear()
    cache._DEFAULTS.clear()
    yield tmp_path / "cache"
    cache._MEMORY.clear()
    cache._DEFAULTS.clear()


def test_candidates_are_the_other_schedule_or_fewer_accumulators_in_turn():
    """Each ping-pong candidate is followed by its twin, its subtile loop in the other form ("u":
    unrolled while tracing), which get_default_kernel builds only where the candidate spills."""
    def listed(config, **kwargs):
        return [(c.tile, c.schedule + (" u" if c.unroll_subtiles else "")) for c in default_candidates(config, **kwargs)]
    pingpong = KernelConfig(tile=(128, 192), cluster=(1, 2), schedule="pingpong", ab_stages=3)
    assert listed(pingpong) == [((128, 192), "pingpong"), ((128, 192), "pingpong u"), ((128, 256), "cooperative"),
                                ((128, 128), "cooperative")]
    assert {(c.cluster, c.ab_stages) for c in default_candidates(pingpong)} == {((1, 2), 3)}  # the rest kept
    # another schedule's candidate takes the form the runtime gives it: ping-pong unrolled
    assert listed(KernelConfig()) == [((128, 256), "cooperative"), ((128, 192), "pingpong u"),
                                      ((128, 192), "pingpong"), ((128, 128), "cooperative")]
    assert listed(KernelConfig(tile=(128, 128))) == [((128, 128), "cooperative"), ((128, 192), "pingpong u"),
                                                     ((128, 192), "pingpong")]
    # a latency-bound ping-pong 128x192 tries ping-pong 128x128 first
    assert listed(pingpong, latency=True) == [
        ((128, 192), "pingpong"), ((128, 192), "pingpong u"), ((128, 128), "pingpong"), ((128, 128), "pingpong u"),
        ((128, 256), "cooperative"), ((128, 128), "cooperative")]
    # sm_100a kernels have no twin: their subtile loop stays rolled
    blackwell = KernelConfig(arch="sm_100a", gpu="B200", tile=(128, 192), cluster=(1, 2), schedule="pingpong")
    assert not any(c.unroll_subtiles for c in default_candidates(blackwell))


def test_only_a_long_ping_pong_128x192_kernel_is_latency_bound():
    """More than LATENCY_BOUND's instructions per accumulator (192 per consumer thread there)."""
    pingpong = KernelConfig(tile=(128, 192), cluster=(1, 2), schedule="pingpong")
    limit = LATENCY_BOUND[2] * 192
    assert latency_bound(pingpong, limit + 1) and not latency_bound(pingpong, limit)
    assert not latency_bound(pingpong, None)  # unknown: taken as it is
    for other in (KernelConfig(), pingpong.with_(tile=(128, 128))):
        assert not latency_bound(other, 10 * limit)


def test_precompile_says_why_calls_run_a_fallback():
    asked = KernelConfig(tile=(128, 192), cluster=(1, 2), schedule="pingpong")
    for why in ("it spills", "its epilogue runs latency-bound there"):
        line = PrecompileResult("p", asked, "compiled", 1.0, chosen=asked.with_(tile=(128, 128)), why=why).line()
        assert line.endswith(f"(compiled); {why}, so calls run tile 128x128 pingpong")
    assert PrecompileResult("p", asked, "disk", 0.1, chosen=asked).line().endswith("(disk)")


def test_stack_frame_bytes_and_instructions_need_a_cubin():
    for read in (stack_frame_bytes, kernel_instructions, local_accesses):
        assert read(None) is None and read(b"not an ELF file") is None
        assert read(b"\x7fELF\x02\x01" + bytes(58)) is None  # no sections, so no frame sizes or code


def test_a_spilling_default_runs_a_candidate_that_does_not_and_the_decision_is_kept(cache_dir, monkeypatch):
    rules = rules_choice(geglu_save)
    assert (rules.tile, rules.schedule) == ((128, 192), "pingpong")
    default = Kernel(geglu_save).kernel_for(rules)[0]
    first = cache.get_default_kernel(geglu_save, rules)  # decided by the call above: from memory
    assert first.config == default and first.tried == []
    records = list((cache_dir / "defaults").glob("*.json"))
    assert [r.stem for r in records] == [cache.cache_key(geglu_save, rules)]
    record = json.loads(records[0].read_text())
    spilled, twin, clean = record["tried"]  # its rules' choice, that with the IR's subtile loop, the fallback
    for kernel in (spilled, twin):
        assert kernel["local_accesses"] > SPILL_TOLERATED_ACCESSES, \
            "geglu_save no longer spills at its rules' choice: find another program"
    assert spilled["config"] == twin["config"] + " unrolled"
    assert clean["stack_frame_bytes"] == 0 and "cooperative" in clean["config"]
    assert (default.tile, default.cluster, default.schedule) == ((128, 256), rules.cluster, "cooperative")
    assert record["chosen"] == {"tile": [128, 256], "cluster": list(rules.cluster), "schedule": "cooperative",
                                "unroll_subtiles": False}
    assert oct(records[0].stat().st_mode & 0o777) == oct(0o600)

    # a fresh start reads the record and loads only the chosen kernel, compiling nothing
    cache._MEMORY.clear()
    cache._DEFAULTS.clear()
    monkeypatch.setattr(cache, "_compile", lambda *args: pytest.fail("compiled with the decision on disk"))
    again = cache.get_default_kernel(geglu_save, rules)
    assert again.config == default and again.tried == [] and again.entry.origin == "disk"
    assert list(cache._MEMORY) == [cache.cache_key(geglu_save, default)]
    assert cache.cached_default(geglu_save, rules) == default

    # a caller who fixes the spilling configuration gets it, with a warning; so does one who
    # fixes the subtile loop's form, which the fallbacks would change
    for fixed in (Kernel(geglu_save, tile=(128, 192), schedule="pingpong"), Kernel(geglu_save, unroll_subtiles=True)):
        with pytest.warns(SpillWarning, match="spills registers"):
            assert fixed.kernel_for(rules)[0] == rules


def test_a_few_values_parked_once_per_tile_are_no_spill():
    """A stack frame counts as a spill only with more than SPILL_TOLERATED_ACCESSES loads and
    stores of it, or where they are not counted; no frame is no spill, whatever the count."""
    def kernel(frame, accesses):
        return CompiledKernel(geglu_save, KernelConfig(), "", None, None, 0.0, stack_frame_bytes=frame,
                              local_accesses=accesses)
    assert not spills(kernel(0, 0)) and not spills(kernel(None, None))
    assert not spills(kernel(24, SPILL_TOLERATED_ACCESSES)) and spills(kernel(24, SPILL_TOLERATED_ACCESSES + 1))
    assert spills(kernel(8, None))


def test_the_swiglu_backward_at_a_deep_k_runs_cooperative_where_it_parks_a_few_values(cache_dir):
    """Beyond K = 4096 the rules choose cooperative 128x256 for heavy epilogues; the SwiGLU
    backward with h spills there (SPILLS_AT in test_compile), a few values once per tile, so that
    tile runs: the Llama MLP's d = 8192 kernel (5.84 ms on an H100 against 6.03 at its spill-free
    ping-pong 128x192, benchmarks/results "Spills that cost nothing")."""
    program = library.get("swiglu_bwd_recompute")
    a, b = torch.empty(1024, 8192, dtype=torch.bfloat16), torch.empty(2048, 8192, dtype=torch.bfloat16)
    problem = bind(program, a, b, {"preact": torch.empty(1024, 4096, dtype=torch.bfloat16)})
    rules = Kernel(program, gpu="H100").config_for(problem)
    assert (rules.tile, rules.schedule) == ((128, 256), "cooperative")
    default = cache.get_default_kernel(program, rules)
    (config, entry), = default.tried
    assert entry.stack_frame_bytes > 0 and 0 < entry.local_accesses <= SPILL_TOLERATED_ACCESSES
    assert default.config == config == rules


def test_ping_pong_kernels_of_large_calls_unroll_the_subtile_loop_and_small_calls_leave_it_to_llvm(cache_dir):
    """The SwiGLU backward with h: at K <= 4096 the rules choose ping-pong 128x192, unrolled while
    tracing, which does not spill (from the IR's loop it does: SPILLS_AT in test_compile); a call
    too small to keep the GPU busy runs cooperative 128x128 (SMALL_CALL_TILE), and with ping-pong
    asked for, takes the IR loop: both quicker to compile (test_gpu_kernels runs all three)."""
    program = library.get("swiglu_bwd_recompute")

    def decided(m, n, k, **fixed):
        a, b = torch.empty(m, k, dtype=torch.bfloat16), torch.empty(n, k, dtype=torch.bfloat16)
        problem = bind(program, a, b, {"preact": torch.empty(m, 2 * n, dtype=torch.bfloat16)})
        rules = Kernel(program, gpu="H100", **fixed).config_for(problem)
        return rules, None if fixed else cache.get_default_kernel(program, rules)
    rules, default = decided(1500, 4104, 2056)
    assert (rules.tile, rules.schedule, rules.unroll_subtiles) == ((128, 192), "pingpong", True)
    (config, entry), = default.tried
    assert config == rules == default.config and entry.stack_frame_bytes == 0
    rules, default = decided(128, 1024, 128)
    assert (rules.tile, rules.schedule, rules.unroll_subtiles, rules.finish_in_gemm) == (
        (128, 128), "cooperative", False, True)
    assert default.config == rules and not spills(default.entry)
    rules, _ = decided(128, 1024, 128, schedule="pingpong")
    assert (rules.tile, rules.schedule, rules.unroll_subtiles) == ((128, 128), "pingpong", False)


def test_a_record_is_only_trusted_for_its_key_and_its_candidates(cache_dir):
    rules = rules_choice(geglu_save)
    cache.get_default_kernel(geglu_save, rules)
    path = next((cache_dir / "defaults").glob("*.json"))
    cache._DEFAULTS.clear()
    record = json.loads(path.read_text())
    for chosen in ({"tile": [64, 256], "cluster": [1, 2], "schedule": "cooperative"}, "128x256", None):
        path.write_text(json.dumps({**record, "chosen": chosen}))
        assert cache.cached_default(geglu_save, rules) is None, chosen
    path.write_text(json.dumps({**record, "key": "0" * 64}))
    assert cache.cached_default(geglu_save, rules) is None
    path.write_text(json.dumps(record))
    path.chmod(0o622)
    with pytest.warns(cache.CacheWarning, match="writable by group"):
        assert cache.cached_default(geglu_save, rules) is None
    path.chmod(0o600)
    assert cache.cached_default(geglu_save, rules) is not None
    assert cache.clear() == 3 and not (cache_dir / "defaults").exists()  # 3 kernels tried, one record


def unwrapped(source: str) -> str:
    """An emitted module with its header's command on one line."""
    return " ".join(source.replace("\\\n", " ").split())


def test_cli_shows_the_decided_kernel_and_precompile_decides(cache_dir, tmp_path, capsys):
    """The CLI builds what a call with K = 4096 runs (runtime_defaults): a random composition
    that is heavy there (2N-wide values) and spills at ping-pong 128x192."""
    source = tmp_path / "composed.py"
    source.write_text(f"import sys\nsys.path.insert(0, {str(Path(__file__).parent)!r})\n"
                      "from random_programs import random_program\n\ncomposed = random_program(14)\n")
    name = f"{source}:composed"
    assert main(["inspect", name]) == 0
    shown = capsys.readouterr().out
    assert "tile 128x192, cluster 1x2, pingpong" in shown
    assert ("a call tries pingpong 128x192 with the other subtile loop where the one before spills, then "
            "cooperative 128x256, then cooperative 128x128") in shown
    assert main(["precompile", name, "--jobs", "1"]) == 0
    out = capsys.readouterr().out
    assert "it spills, so calls run tile 128x256 cooperative" in out and "1 kernel in" in out
    assert main(["emit", name]) == 0
    assert "--tile 128x256 --cluster 1x2 --schedule cooperative" in unwrapped(capsys.readouterr().out)
    assert main(["emit", name, "--schedule", "pingpong"]) == 0  # a flag given: no decision applies
    assert "--tile 128x192 --cluster 1x2 --schedule pingpong" in unwrapped(capsys.readouterr().out)
    # another process with the same cache goes straight to the decided kernel
    code = ("from coda_cute import cache, library; from coda_cute.config import KernelConfig; "
            f"p = library.resolve({name!r}); "
            "d = cache.get_default_kernel(p, KernelConfig(tile=(128, 192), cluster=(1, 2), schedule='pingpong', "
            "unroll_subtiles=True)); "
            "print(d.config.tile, d.entry.origin, d.tried)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert done.stdout.split("\n")[0] == "(128, 256) disk []"


# four whose rules' choice is ping-pong 128x192 (where seeds 5 and 34 park a few values in local
# memory, and the epilogues of seeds 11 and 34 run latency-bound), two cooperative 128x256
SAMPLE_SEEDS = (1, 5, 11, 34, 0, 3)
PARKING_SEEDS = {5, 34}  # a stack frame, and no more loads and stores of it than tolerated
LATENCY_SEEDS = {11, 34}  # bench_programs' random_11: 1.88x our GEMM at ping-pong 128x192, 1.04x at 128x128


@pytest.mark.parametrize("seed", SAMPLE_SEEDS)
def test_the_default_of_a_random_composition_never_spills_where_a_candidate_does_not(seed, cache_dir):
    """Nor runs latency-bound where a candidate that does not spill does not."""
    program = random_program(seed)
    rules = rules_choice(program)
    default = cache.get_default_kernel(program, rules)
    frames = [entry.stack_frame_bytes for _, entry in default.tried]
    lengths = [entry.instructions for _, entry in default.tried]
    counts = [entry.local_accesses for _, entry in default.tried]
    assert all(isinstance(f, int) for f in frames + lengths + counts), "the cubin's frames or code are unreadable"
    spilling = [spills(entry) for _, entry in default.tried]
    assert (frames[0] > 0 and not spilling[0]) == (seed in PARKING_SEEDS), f"seed {seed}: update PARKING_SEEDS"
    slow = not spilling[0] and latency_bound(rules, lengths[0])
    assert slow == (seed in LATENCY_SEEDS), f"seed {seed}: update LATENCY_SEEDS"
    if spills(default.entry):  # then every candidate spills, and each was tried
        assert default.config == rules and len(default.tried) == len(default_candidates(rules)) and all(spilling)
    assert len(default.tried) == 1 or spilling[0] or slow, \
        "a fallback was compiled where the rules' choice neither spills nor runs latency-bound"
    if slow:  # ping-pong 128x128 first, which holds a third fewer accumulators
        assert default.tried[1][0].tile == (128, 128) and default.tried[1][0].schedule == "pingpong"
        assert default.config == default.tried[1][0] and not spilling[1]

"""benchmarks/bench_programs.py on the CPU: its --smoke run times every contender of every
program kind through the reference interpreter, and the program set is what the issue of
untuned programs asks for (at least 20, transcendental-heavy ones among them)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_program_set_covers_the_library_generated_and_transcendental_programs(load_benchmark):
    bench = load_benchmark("bench_programs")
    kinds = [kind for kind, _ in bench.programs(bench.KINDS)]
    assert kinds.count("random") == 12 and kinds.count("transcendental") == 6 and kinds.count("library") >= 15
    assert kinds.count("derived") == len(bench.DERIVED_FROM)
    transcendental = {n.op for _, p in bench.programs(["transcendental"]) for n in p.nodes}
    assert {"exp", "log", "tanh", "gelu", "gelu_tanh", "sigmoid", "silu"} <= transcendental


def test_torch_compile_contender_is_one_graph_per_program(load_benchmark):
    """torch.compile sees each program's unfused math whole (no graph break, class indices
    included) and compiles each in its own frame, so a later program does not fall back to eager."""
    import torch

    bench = load_benchmark("bench_programs")
    for name in ("cross_entropy_stats", "bias_gelu", "swiglu", "rmsnorm_bwd", "residual_sumsq",
                 "rms_swiglu_save", "gemm", "alpha_beta", "swiglu_bwd", "rope_qkv"):
        program = bench.library.get(name)
        a, b, operands = bench.random_call(program, 256, 256, 32, torch.bfloat16, device="cpu")
        torch.compile(bench.unfused(program), backend="eager", fullgraph=True, dynamic=False)(a, b, operands)


def test_smoke_run_times_every_contender(tmp_path):
    out = tmp_path / "programs.json"
    # two programs of each kind but the library's (the set itself is the test above)
    chosen = ["random_0", "random_5", "erf_gelu_gate", "geglu_tanh_sumsq", "bias_gelu_backward",
              "cross_entropy_stats_backward"]
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_programs.py"), "--smoke",
                           "--kinds", "random", "transcendental", "derived", "--programs", *chosen,
                           "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["meta"]["gpu"] == "cpu (--smoke)" and [r["program"] for r in data["rows"]] == chosen
    for row in data["rows"]:
        assert all(row[c]["ms"] > 0 for c in ("fused", "fused autotune", "GEMM", "torch.compile")), row["program"]
        assert row["rel_err"] < 2e-2 and row["fused_over_gemm"] > 0
    assert "== summary" in done.stdout and "transcendental (2)" in done.stdout

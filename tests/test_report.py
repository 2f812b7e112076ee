"""benchmarks/report.py turns result files into RESULTS.md's tables (CPU only, no torch)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REPORT = ROOT / "benchmarks" / "report.py"


def _run(*args):
    done = subprocess.run([sys.executable, str(REPORT), *map(str, args)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done


def _timing(ms, **extra):
    return {"ms": ms, "spread": 0.05, **extra}


def test_report_renders_ops_block_and_runtime_files(tmp_path):
    meta = {"date": "2030-01-02", "gpu": "NVIDIA H200", "commit": "abc1234", "command": "python benchmarks/x.py --d 2048"}
    ops = {"meta": meta, "rows": [
        {"d": 2048, "op": "GEMM QKV", "config": "sm_90a H200 (132 SMs), bf16 inputs, majors kk, tile 128x256",
         "cuBLAS kernel": ["nvjet"], "coda-cute": _timing(0.150), "cuBLAS GEMM alone": _timing(0.148),
         "torch.compile default": _timing(0.149)},
        {"d": 2048, "op": "O GEMM + residual + sumsq", "coda-cute": _timing(0.110), "coda-cute GEMM alone": _timing(0.100),
         "cuBLAS GEMM alone": _timing(0.099), "torch.compile default": _timing(0.132)}]}
    block = {"meta": dict(meta, commit="def5678"), "rows": [  # a contender with the newer keys, one without
        {"d": 2048, "what": "block forward+backward", "tokens": 8192,
         "coda-cute": _timing(5.5, gpu_ms=5.25, peak_gib=12.5, kernels=[{"name": "k", "ms": 1.0}], later_key=3),
         "torch.compile": _timing(5.75)}]}
    runtime = {"meta": meta, "kernels": [{"program": "gemm", "compile_s": 0.9, "first_call_s": 1.0, "warm_load_ms": 41.0,
                                          "import_ms": 9.0, "library_ms": 4.0, "key_ms": 23.0, "load_ms": 5.0}],
               "host_overhead_us": {"gemm": {"coda-cute host": 13.9, "cuBLAS host": 14.1}}}
    programs = {"meta": meta, "rows": [
        {"program": "swiglu_bwd", "kind": "library", "shape": "8192x2048x2048", "config": "tile 128x192 pingpong",
         "autotune_config": "tile 128x128 pingpong", "fused": _timing(0.118), "fused autotune": _timing(0.1),
         "GEMM": _timing(0.1), "torch.compile": _timing(1.0), "fused_over_gemm": 1.18}]}
    paths = []
    for name, data in (("ops", ops), ("block", block), ("programs", programs), ("runtime", runtime)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(data))
    out = tmp_path / "RESULTS.md"
    done = _run(*paths, tmp_path / "gone.json", "-o", out)
    text = out.read_text()

    assert "## d = 2048" in text and "abc1234" in text and "`python benchmarks/x.py --d 2048`" in text
    assert "| O GEMM + residual + sumsq | 1.100 | 1.111 | 1.20 | 0.110 | 0.100 | 0.099 | 0.132 | 5 % | - |" in text
    assert "| GEMM QKV | - | 1.014 |" in text and "| tile 128x256 |" in text
    assert "| case | contender | ms | spread | x torch.compile | GPU ms | peak GiB |" in text
    assert "| block forward+backward | coda-cute | 5.500 | 5 % | 0.957 | 5.250 | 12.5 |" in text
    assert "| block forward+backward | torch.compile | 5.750 | 5 % | 1.000 | - | - |" in text
    assert "| gemm | 0.9 | 1.0 | 41.0 | - | 9.0 / 4.0 / 23.0 / - / 5.0 | - |" in text and "| gemm | 13.9 | 14.1 | - | - |" in text
    assert "## Programs nobody tuned" in text and "programs.json`: programs" in text
    assert ("| swiglu_bwd | library | 8192x2048x2048 | 1.180 | 1.000 | 10.000 | tile 128x192 pingpong | "
            "tile 128x128 pingpong |") in text
    assert "gone.json`: **missing**" in text and "gone.json: missing" in done.stderr
    assert "sm_100a (Blackwell) kernels are\ncompile-verified only" in text, "RESULTS must say Blackwell never ran"


def test_default_inputs_exist_and_results_md_is_current(tmp_path):
    """RESULTS.md is what report.py makes of its INPUTS: regenerate it after archiving a run."""
    out = tmp_path / "RESULTS.md"
    done = _run("-o", out)
    assert not done.stderr, done.stderr
    assert out.read_text() == (ROOT / "benchmarks" / "RESULTS.md").read_text()

"""benchmarks/bench_compile.py on the CPU: it compiles a library kernel as a small call configures
it, records where it ran, and --without-small-call-tile gives the rules' tile for that call."""

import json
import subprocess
import sys
from pathlib import Path

from coda_cute import library

ROOT = Path(__file__).resolve().parent.parent


def test_small_call_configs_with_and_without_the_small_call_tile(load_benchmark):
    bench = load_benchmark("bench_compile")
    swiglu_bwd = library.get("swiglu_bwd")
    small = bench.call_config(swiglu_bwd, 128, 1024, 128, without_small_call_tile=False)
    before = bench.call_config(swiglu_bwd, 128, 1024, 128, without_small_call_tile=True)
    assert (small.tile, small.schedule) == ((128, 128), "cooperative")
    assert (before.tile, before.schedule, before.unroll_subtiles) == ((128, 128), "pingpong", False)
    dw = bench.call_config(library.get("cross_entropy_dw"), 128, 1024, 128, without_small_call_tile=False)
    assert dw.majors == "mk"  # its A transform takes the logits' transpose


def test_compiles_and_records(tmp_path):
    out = tmp_path / "compile.json"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_compile.py"), "--programs", "gemm",
                          "--rounds", "1", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    record = json.loads(out.read_text())
    (row,) = record["rows"]
    assert row["program"] == "gemm" and "tile 128x128" in row["config"] and "cooperative" in row["config"]
    assert row["compile_s"] > 0 and row["sass_instructions"] > 100 and row["stack_frame_bytes"] == 0
    assert {"date", "machine", "commit", "command"} <= set(record["meta"])

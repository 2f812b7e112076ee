"""The `coda-cute` command: in-process through ``main([...])`` and once as a real process.

Compiles three kernels in all (emit --compile, inspect --sass --regs, precompile), each
~1-2 s on a CPU; everything else only renders."""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from coda_cute import library
from coda_cute.arguments import bind
from coda_cute.cache import cache_key, list_entries
from coda_cute.precompile import precompile
from coda_cute.cli import build_parser, main, precompile_requests
from coda_cute.config import KernelConfig
from coda_cute.errors import UnsupportedError
from coda_cute.render import emit
from coda_cute.runtime import Kernel, runtime_defaults

ROOT = Path(__file__).resolve().parent.parent


def cli(capsys, *args):
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    monkeypatch.setenv("CODA_CUTE_CACHE_DIR", str(folder))
    monkeypatch.delenv("CODA_CUTE_NO_DISK_CACHE", raising=False)
    return folder


def header_command(source: str) -> list[str]:
    """The regenerating command an emitted kernel prints in its header (continued over lines
    ending in a backslash, as in a shell), as argv."""
    header = source[:source.index("\nThe program")].replace(" \\\n", " ")
    lines = [line.strip() for line in header.splitlines() if line.strip().startswith("coda-cute emit ")]
    assert len(lines) == 1, "the header must print exactly one `coda-cute emit` line"
    return shlex.split(lines[0])


# ----------------------------------------------------------------------------- list / show
def test_list_has_one_line_per_program_with_outputs_and_summary(capsys):
    code, out, err = cli(capsys, "list")
    assert code == 0 and err == ""
    lines = {line.split()[0]: line for line in out.splitlines()[1:]}
    assert set(lines) == set(library.programs())
    for name, program in library.programs().items():
        assert program.doc.strip().splitlines()[0] in lines[name]
    assert re.search(r"^swiglu\s+D N/2\s", lines["swiglu"])
    assert re.search(r"^swiglu_bwd\s+D 2N\s", lines["swiglu_bwd"])
    assert "D N, sumsq row_sumsq" in lines["residual_sumsq"]
    assert "dgamma col_sum" in lines["rmsnorm_bwd"]


def test_list_names_prints_only_names(capsys):
    code, out, _ = cli(capsys, "list", "--names")
    assert code == 0
    assert out.splitlines() == list(library.programs())


def test_show_prints_the_program_listing(capsys):
    code, out, _ = cli(capsys, "show", "residual_sumsq")
    assert code == 0
    assert out == library.get("residual_sumsq").describe() + "\n"
    assert "residual: tile (M, N)" in out and "sumsq = row_sumsq(h)" in out


# ----------------------------------------------------------------------------- emit
@pytest.mark.parametrize("name, flags", [
    ("gemm", []),
    ("swiglu", ["--gpu", "H100", "--dtype", "f16", "--majors", "mn", "--tile", "128x128", "--cluster", "1x2"]),
    ("residual_sumsq", ["--tile", "64x256", "--cluster", "1x1", "--operand-dtype", "residual=f32"]),
    ("residual_sumsq", ["--ab-stages", "3"]),  # the residual ring then holds the whole tile
    ("rmsnorm_bwd", ["--finish-in-gemm"]),  # reductions folded by the GEMM's last tiles
    ("swiglu_bwd", ["--tile", "128x192", "--schedule", "pingpong", "--no-unroll-subtiles"]),  # small calls' form
    ("swiglu", ["--unroll-subtiles"]),  # a cooperative kernel unrolled while tracing
    ("gemm", ["--raster", "n", "--swizzle", "8"]),
    ("gemm", ["--swizzle", "1"]),  # CuTe's walk as it is, no swizzled_tile
    ("rms_scale_gamma", ["--tile", "64x256", "--schedule", "pingpong", "--operand-dtype", "rstd=f32",
                         "--operand-dtype", "gamma=bf16"]),
])
def test_emit_to_stdout_matches_render_and_its_header_command_round_trips(capsys, name, flags):
    code, out, err = cli(capsys, "emit", name, *flags)
    assert code == 0 and err == ""
    parsed = build_parser().parse_args(["emit", name, *flags])
    from coda_cute.cli import _config

    program = library.get(name)
    assert out == emit(program, _config(program, parsed))
    compile(out, f"{name}.py", "exec")
    argv = header_command(out)
    assert argv[:3] == ["coda-cute", "emit", name]
    code, again, _ = cli(capsys, *argv[1:])
    assert code == 0 and again == out, "the header's command must regenerate the same kernel"


def test_emit_flags_reach_the_kernel(capsys):
    _, out, _ = cli(capsys, "emit", "rms_scale_gamma", "--gpu", "H20", "--dtype", "f16", "--majors", "mk",
                    "--tile", "64x128", "--cluster", "1x1", "--operand-dtype", "rstd=f32")
    config = KernelConfig(gpu="H20", dtype="f16", majors="mk", tile=(64, 128), cluster=(1, 1),
                          operand_dtypes=(("rstd", "f32"),))
    assert out == emit(library.get("rms_scale_gamma"), config)
    assert "TILE_M, TILE_N, TILE_K = 64, 128" in out and "cutlass.Float16" in out
    assert "in_rstd (M,) f32" in out and "in_gamma (N,) f16" in out
    _, folded, _ = cli(capsys, "emit", "residual_sumsq", "--tile", "128x256", "--cluster", "2x1", "--finish-in-gemm")
    assert folded == emit(library.get("residual_sumsq"), KernelConfig(finish_in_gemm=True))
    assert "arrivals (ceil(M / TILE_M) + ceil(N / TILE_N),) i32" in folded and "use_pdl" not in folded


def test_emit_writes_a_python_file(capsys, tmp_path):
    target = tmp_path / "swiglu_kernel.py"
    code, out, err = cli(capsys, "emit", "swiglu", "--tile", "128x128", "-o", str(target))
    assert code == 0 and out == ""
    assert str(target) in err
    source = target.read_text()
    compile(source, str(target), "exec")
    assert "coda-cute kernel `swiglu`" in source
    assert header_command(source) == shlex.split(
        "coda-cute emit swiglu --arch sm_90a --gpu H200 --dtype bf16 --majors kk --tile 128x128 --cluster 1x2 "
        "--schedule cooperative --swizzle 4")


@pytest.mark.parametrize("name,flags,want", [
    ("gemm", ["--schedule", "pingpong"], "tile 128x128, cluster 1x2, pingpong"),
    ("swiglu_bwd", ["--schedule", "cooperative"], "tile 128x256, cluster 1x2, cooperative"),
    ("swiglu_bwd", ["--tile", "128x192"], "tile 128x192, cluster 1x2, cooperative"),
    ("swiglu_bwd", ["--cluster", "2x1"], "tile 128x192, cluster 2x1, pingpong"),
])
def test_emit_fills_what_the_flags_leave_out_as_kernel_does(capsys, name, flags, want):
    """A schedule alone gets that schedule's default tile, a tile alone runs cooperative, a
    missing cluster follows the default rule: the same as Kernel(program, **given)."""
    code, out, err = cli(capsys, "emit", name, *flags, "-o", os.devnull)
    assert code == 0 and want in err


def test_emit_defaults_to_the_kernel_the_runtime_picks(capsys):
    """Without tile / cluster / schedule flags, emit shows what `Kernel` would run on a large problem."""
    program = library.get("swiglu_bwd")
    tile, cluster, schedule = runtime_defaults(program)
    assert (tile, schedule) == ((128, 192), "pingpong")  # a heavy epilogue (2N-wide tiles)
    code, out, _ = cli(capsys, "emit", "swiglu_bwd")
    assert code == 0 and out == emit(program, KernelConfig(tile=tile, cluster=cluster, schedule=schedule,
                                                           unroll_subtiles=True))  # as large calls have it


@pytest.mark.compile
def test_emit_compile_cross_compiles_without_a_gpu(capsys, tmp_path):
    code, out, err = cli(capsys, "emit", "gemm", "--tile", "128x128", "--cluster", "1x1",
                         "-o", str(tmp_path / "gemm.py"), "--compile")
    assert code == 0, err
    assert re.search(r"^compiled gemm for sm_90a in \d+\.\d\d s$", err, re.M), err


# ----------------------------------------------------------------------------- your own programs
USER_PROGRAM = """
import coda_cute as cc


@cc.epilogue
def soft_cap(acc, bias: cc.ColVec, *, cap=30.0):
    \"\"\"cap * tanh((acc + bias) / cap)\"\"\"
    return cap * cc.tanh((acc + bias) / cap)


not_a_program = 3
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """The same program in a file and in an importable module (``my_epilogues``)."""
    (tmp_path / "my_epilogues.py").write_text(USER_PROGRAM)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path / "my_epilogues.py"
    sys.modules.pop("my_epilogues", None)


@pytest.mark.parametrize("how", ["file", "module"])
def test_user_programs_emit_show_and_regenerate_byte_for_byte(capsys, user_module, how):
    reference = f"{user_module}:soft_cap" if how == "file" else "my_epilogues:soft_cap"
    code, out, err = cli(capsys, "show", reference)
    assert code == 0 and "program soft_cap" in out and "bias: col" in out
    code, out, err = cli(capsys, "emit", reference, "--tile", "128x128")
    assert code == 0, err
    argv = header_command(out)
    assert argv[:3] == ["coda-cute", "emit", reference]
    code, again, _ = cli(capsys, *argv[1:])
    assert code == 0 and again == out, "the header's command must regenerate the same kernel"


def test_api_emitted_header_names_where_the_program_lives(capsys, user_module):
    """render.emit of a program defined in a module prints the command that finds it again."""
    import importlib

    program = importlib.import_module("my_epilogues").soft_cap
    source = emit(program, KernelConfig(tile=(128, 128), cluster=(1, 2)))
    argv = header_command(source)
    assert argv[2] == "my_epilogues:soft_cap"
    code, again, _ = cli(capsys, *argv[1:])
    assert code == 0 and again == source
    variant = program.with_constants(cap=5.0)  # no name reaches it: the header says how to get it
    assert "coda_cute.render.emit(program, config)" in emit(variant, KernelConfig())


def test_backward_show_emit_inspect(capsys, user_module):
    code, out, _ = cli(capsys, "show", "--backward", "swiglu")
    assert code == 0 and "derivative of swiglu" in out and "program swiglu_backward" in out
    assert "preact: tile (M, 2N)" in out
    for reference in ("swiglu", f"{user_module}:soft_cap"):
        code, out, err = cli(capsys, "emit", "--backward", reference)
        assert code == 0, err
        argv = header_command(out)
        assert argv[:4] == ["coda-cute", "emit", "--backward", reference]
        code, again, _ = cli(capsys, *argv[1:])
        assert code == 0 and again == out


@pytest.mark.parametrize("suffix, expected", [
    (":nope", "has no 'nope'; its programs: soft_cap"),
    (":not_a_program", "'not_a_program' holds a int, not a program"),
])
def test_user_program_errors(capsys, user_module, suffix, expected):
    code, _, err = cli(capsys, "emit", f"{user_module}{suffix}")
    assert code == 2 and expected in err
    code, _, err = cli(capsys, "show", str(user_module.parent / "missing.py") + ":x")
    assert code == 2 and "no file" in err
    code, _, err = cli(capsys, "emit", "no_such_module_here:x")
    assert code == 2 and "cannot import module 'no_such_module_here'" in err


def test_precompile_takes_user_programs(capsys, cache_dir, user_module):
    [(program, config)] = precompile_requests(build_parser().parse_args(
        ["precompile", f"{user_module}:soft_cap", "--tile", "128x128"]))
    assert program.name == "soft_cap" and config.tile == (128, 128)


# ----------------------------------------------------------------------------- inspect
@pytest.mark.compile
def test_inspect_shows_sass_and_register_report(capsys, tmp_path):
    code, out, err = cli(capsys, "inspect", "swiglu", "--sass", "--regs", "--dump-dir", str(tmp_path / "dump"))
    assert code == 0, err
    assert out.startswith("# swiglu: sm_90a H200 (132 SMs)")
    assert "# ---- SASS" in out and "HGMMA" in out and "UTMASTG" in out
    registers = re.search(r"^registers: (\d+) per thread; spills: (\d+) bytes$", out, re.M)
    assert registers, out[-2000:]
    assert 0 < int(registers[1]) <= 255 and int(registers[2]) == 0
    assert re.search(r"ptxas info\s*: Used \d+ registers", out)
    assert "\x1b[" not in out, "terminal color codes leaked into the report"
    assert list((tmp_path / "dump").glob("*.sass")), "--dump-dir keeps the artifacts"


@pytest.mark.compile
def test_inspect_says_why_a_default_with_a_stack_frame_runs(capsys, monkeypatch, tmp_path):
    """cross_entropy_stats_save's default (ping-pong 128x192) parks a few values in local memory:
    inspect says how many loads and stores, and that a default may run it."""
    monkeypatch.setenv("CODA_CUTE_CACHE_DIR", str(tmp_path / "cache"))
    code, out, err = cli(capsys, "inspect", "cross_entropy_stats_save")
    assert code == 0, err
    assert "tile 128x192, cluster 1x2, pingpong" in out.split("\n")[0]
    parked = re.search(r"^# a (\d+)-byte stack frame with (\d+) loads and stores of it in the SASS: .* which a "
                       r"default may run \(at most 16: cache.SPILL_TOLERATED_ACCESSES\)$", out, re.M)
    assert parked, out[:1000]
    assert int(parked[1]) > 0 and 0 < int(parked[2]) <= 16
    assert "no default is decided" not in out
    # a kernel asked for with flags that spills in more places is not said to park a few values
    code, out, err = cli(capsys, "inspect", "rmsnorm_bwd", "--tile", "128x192", "--schedule", "pingpong")
    assert code == 0, err
    assert "stack frame with" not in out and re.search(r"^registers: \d+ per thread; spills: [1-9]\d* bytes$", out, re.M)


# ----------------------------------------------------------------------------- errors
@pytest.mark.parametrize("args, expected", [
    (["emit", "no_such_program"], ["no library program named 'no_such_program'", "available:", "gemm", "swiglu"]),
    (["show", "nope"], ["no library program named 'nope'"]),
    (["emit", "gemm", "--tile", "12x"], ["tile '12x'", "128x256"]),
    (["emit", "gemm", "--tile", "96x96"], ["tile 96x96 is not supported", "128x256", "64x128"]),
    (["emit", "gemm", "--cluster", "4x4"], ["cluster 4x4 is not supported", "2x1"]),
    (["emit", "gemm", "--arch", "sm_120a"], ["arch 'sm_120a' is not supported", "sm_90a"]),
    (["emit", "gemm", "--arch", "sm_100a", "--gpu", "H200"], ["GPU 'H200' runs sm_90a kernels, not sm_100a", "B200"]),
    (["emit", "gemm", "--gpu", "A100"], ["GPU 'A100'", "H200"]),
    (["emit", "gemm", "--dtype", "f32"], ["input dtype 'f32'"]),
    (["emit", "gemm", "--majors", "nk"], ["majors 'nk'"]),
    (["emit", "gemm", "--schedule", "pingpong", "--tile", "128x256"], ["ping-pong", "192 registers"]),
    (["emit", "gemm", "--schedule", "fast"], ["schedule 'fast'", "cooperative, pingpong"]),
    (["emit", "gemm", "--swizzle", "3"], ["swizzle 3: expected one of 1, 2, 4, 8"]),
    (["emit", "gemm", "--raster", "k"], ["raster 'k': expected m", "or n"]),
    (["precompile", "gemm", "--schedule", "fast"], ["schedule 'fast'"]),
    (["precompile", "gemm", "--gpu", "A100"], ["GPU 'A100'"]),
    (["precompile", "gemm", "--tile", "128x256", "--schedule", "pingpong"], ["nothing to precompile"]),
    (["emit", "bias_gelu", "--operand-dtype", "bias"], ["expected NAME=DTYPE"]),
    (["emit", "bias_gelu", "--operand-dtype", "gamma=f32"], ["no tensor operand 'gamma'", "bias"]),
    (["emit", "bias_gelu", "--operand-dtype", "bias=fp8"], ["dtype 'fp8'", "bf16, f16, f32"]),
    (["emit", "alpha_beta", "--operand-dtype", "alpha=f32"], ["'alpha' is a Scalar"]),
    (["inspect", "gemm", "--tile", "1x"], ["tile '1x'"]),
    (["precompile"], ["name the programs to precompile, or --all"]),
    (["precompile", "gemm", "--all"], ["not both"]),
    (["precompile", "gemm", "--jobs", "0"], ["--jobs 0"]),
    (["precompile", "--all", "--operand-dtype", "nothing=f32"], ["'nothing'"]),
    (["precompile", "gemm", "--tile", "128x256", "--tile", "96x96"], ["tile 96x96"]),
])
def test_user_errors_are_one_line_with_status_2(capsys, cache_dir, args, expected):
    code, out, err = cli(capsys, *args)
    assert code == 2
    assert out == ""
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("coda-cute: error: "), err
    for fragment in expected:
        assert fragment in lines[0]
    assert not cache_dir.exists(), "a rejected command compiled nothing"


def test_usage_errors_and_help(capsys):
    assert cli(capsys, "frobnicate")[0] == 2
    code, out, _ = cli(capsys, "--help")
    assert code == 0 and all(c in out for c in ("list", "show", "emit", "inspect", "cache", "precompile"))
    code, out, _ = cli(capsys, "emit", "--help")
    assert code == 0 and "--operand-dtype NAME=DTYPE" in out and "--compile" in out


def _script_or_module(kind):
    if kind == "module":
        return [sys.executable, "-m", "coda_cute.cli"]
    script = Path(sys.executable).parent / "coda-cute"
    if not script.exists():
        pytest.skip("the coda-cute console script is not installed in this environment")
    return [str(script)]


@pytest.mark.parametrize("kind", ["module", "script"])
def test_real_process(kind, tmp_path):
    """As a user runs it: exit statuses, stdout, and an error without a traceback."""
    command = _script_or_module(kind)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               PYTHONWARNINGS="ignore", CODA_CUTE_CACHE_DIR=str(tmp_path / "cache"))
    ok = subprocess.run(command + ["list", "--names"], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.splitlines() == list(library.programs())
    bad = subprocess.run(command + ["emit", "gemm", "--tile", "96x96"], capture_output=True, text=True,
                         env=env, cwd=tmp_path)
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.splitlines() == [
        "coda-cute: error: tile 96x96 is not supported; choose one of 128x256, 256x128, 128x192, 128x128, 128x64, "
        "64x256, 64x128, 256x256"]


# ----------------------------------------------------------------------------- cache / precompile
def _runtime_key(name: str, m=8192, n=8192, k=64, schedule=None, **dtypes):
    """The cache key a GPU call of Kernel(program, schedule=schedule) would ask for at the large
    problem precompile builds for (8192 x 8192, computed on CPU tensors)."""
    program = library.get(name)
    a, b = torch.zeros(m, k, dtype=torch.bfloat16), torch.zeros(n, k, dtype=torch.bfloat16)
    operands = {}
    for op in program.operands:
        if op.kind == "scalar":
            operands[op.name] = 1.0
        else:
            cols = int(n * op.width) if op.width is not None else None
            shape = {"row": (m,), "col": (cols,), "tile": (m, cols), "table": (4, 8)}[op.kind]
            operands[op.name] = torch.zeros(shape, dtype=dtypes.get(op.name, torch.bfloat16))
    config = Kernel(program, gpu="H200", schedule=schedule).config_for(bind(program, a, b, operands))
    return cache_key(program, config)


@pytest.mark.parametrize("name", ["gemm", "swiglu", "swiglu_bwd", "residual_sumsq", "rms_scale_gamma", "alpha_beta"])
def test_precompile_defaults_are_the_keys_the_runtime_asks_for(name):
    """Without --tile/--cluster, precompile builds what Kernel picks for a large problem, under
    the cache key a real call computes (operand dtypes spelled out as the runtime does)."""
    [(program, config)] = precompile_requests(build_parser().parse_args(["precompile", name]))
    assert cache_key(program, config) == _runtime_key(name)


def test_precompile_builds_what_small_calls_run_when_told():
    """A call too small to keep the GPU busy runs cooperative 128x128 and finishes its reductions
    in the GEMM: --tile 128x128 --finish-in-gemm ask precompile for that kernel; with ping-pong
    asked for, such a call leaves the subtile loop to LLVM (--no-unroll-subtiles)."""
    args = build_parser().parse_args(["precompile", "swiglu_bwd_recompute", "--tile", "128x128", "--finish-in-gemm"])
    [(program, config)] = precompile_requests(args)
    assert config.finish_in_gemm and (config.tile, config.schedule) == ((128, 128), "cooperative")
    assert cache_key(program, config) == _runtime_key("swiglu_bwd_recompute", m=128, n=1024, k=128)
    args = build_parser().parse_args(["precompile", "swiglu_bwd_recompute", "--tile", "128x128", "--schedule",
                                      "pingpong", "--finish-in-gemm", "--no-unroll-subtiles"])
    [(program, config)] = precompile_requests(args)
    assert config.finish_in_gemm and not config.unroll_subtiles
    assert cache_key(program, config) == _runtime_key("swiglu_bwd_recompute", m=128, n=1024, k=128,
                                                      schedule="pingpong")


def test_precompile_table_flags_reach_the_config():
    """--table-period and --stage-tables build the kernel a call with staged tables runs; with
    --all, a period goes to the programs with that table, and a name none has is an error."""
    args = build_parser().parse_args(["precompile", "rope_qkv", "--table-period", "cos=64", "--table-period", "sin=64",
                                      "--stage-tables"])
    [(program, config)] = precompile_requests(args)
    assert config.stage_tables and config.table_periods == (("cos", 64), ("sin", 64))
    pairs = precompile_requests(build_parser().parse_args(["precompile", "--all", "--table-period", "cos=64"]))
    assert {p.name for p, c in pairs if c.table_periods} == {p.name for p, _ in pairs
                                                             if any(op.name == "cos" for op in p.operands)}
    with pytest.raises(UnsupportedError, match="--table-period cosine=64: no library program has a table operand"):
        precompile_requests(build_parser().parse_args(["precompile", "--all", "--table-period", "cosine=64"]))


def test_precompile_operand_dtype_reaches_the_key():
    args = build_parser().parse_args(["precompile", "rms_scale_gamma", "--operand-dtype", "rstd=f32"])
    [(program, config)] = precompile_requests(args)
    assert cache_key(program, config) == _runtime_key("rms_scale_gamma", rstd=torch.float32)
    assert cache_key(program, config) != _runtime_key("rms_scale_gamma")


def test_precompile_cross_product_of_repeated_flags():
    args = build_parser().parse_args(["precompile", "gemm", "swiglu", "--tile", "128x256", "--tile", "128x128",
                                      "--cluster", "1x1", "--cluster", "2x1", "--dtype", "f16"])
    pairs = precompile_requests(args)
    assert len(pairs) == 2 * 2 * 2
    assert {(p.name, c.tile, c.cluster, c.dtype) for p, c in pairs} == {
        (n, t, c, "f16") for n in ("gemm", "swiglu") for t in ((128, 256), (128, 128)) for c in ((1, 1), (2, 1))}


def test_precompile_cross_product_with_schedules():
    args = build_parser().parse_args(["precompile", "gemm", "--tile", "128x256", "--tile", "64x256",
                                      "--schedule", "cooperative", "--schedule", "pingpong"])
    pairs = precompile_requests(args)
    assert {(c.tile, c.schedule) for _, c in pairs} == {
        (t, s) for t in ((128, 256), (64, 256)) for s in ("cooperative", "pingpong")}


def test_precompile_api_skips_what_cannot_be_built(cache_dir):
    results = precompile(["gemm"], [KernelConfig(tile=(96, 96)), KernelConfig(arch="sm_100a"),
                                    KernelConfig(schedule="pingpong"),
                                    KernelConfig(operand_dtypes=(("bias", "f32"),))], jobs=1)
    assert [r.status for r in results] == ["skipped"] * 4
    assert "tile (96, 96)" in results[0].message and "sm_100a" in results[1].message
    assert "ping-pong" in results[2].message and "no tensor operand 'bias'" in results[3].message
    assert not results[0].ok
    assert not list_entries()


def test_cache_commands_and_precompile(capsys, cache_dir):
    code, out, _ = cli(capsys, "cache", "path")
    assert code == 0 and out == f"{cache_dir}\n"
    code, out, _ = cli(capsys, "cache", "ls")
    assert code == 0 and out == f"no kernels cached in {cache_dir}\n"

    code, out, err = cli(capsys, "precompile", "residual_sumsq", "--jobs", "1")
    assert code == 0, err
    (tm, tn), (cm, cn), schedule = runtime_defaults(library.get("residual_sumsq"))
    assert re.search(rf"^\[1/1\] residual_sumsq bf16 kk tile {tm}x{tn} cluster {cm}x{cn} {schedule} H200: "
                     r"\d+\.\d\d s \(compiled\)$",
                     out, re.M), out
    assert f"1 kernel in {cache_dir} (1 compiled, 0 already cached)" in out
    [entry] = list_entries()
    assert entry["program"] == "residual_sumsq"
    assert entry["key"] == _runtime_key("residual_sumsq"), "a GPU call with bf16 tensors must find this kernel"
    manifest = json.loads((Path(entry["path"]) / "manifest.json").read_text())
    assert (Path(entry["path"]) / "kernel.o").stat().st_size > 0 and manifest["compile_seconds"] > 0

    code, out, _ = cli(capsys, "cache", "ls")
    assert code == 0
    assert out.splitlines()[0] == f"1 kernel in {cache_dir}"
    assert entry["key"][:12] in out and "residual_sumsq" in out and f"tile {tm}x{tn}, cluster {cm}x{cn}" in out

    code, out, err = cli(capsys, "precompile", "residual_sumsq", "--jobs", "1")  # second time: loaded, not built
    assert code == 0, err
    assert re.search(r"^\[1/1\] residual_sumsq .*: \d+\.\d\d s \(disk\)$", out, re.M), out
    assert "(0 compiled, 1 already cached)" in out

    code, out, _ = cli(capsys, "cache", "clear")
    assert code == 0 and out == f"removed 1 kernel from {cache_dir}\n"
    assert cli(capsys, "cache", "ls")[1] == f"no kernels cached in {cache_dir}\n"

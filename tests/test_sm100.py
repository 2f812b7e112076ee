"""Blackwell (sm_100a): every library program either cross-compiles for sm_100a on this
(GPU-less) machine, with the SASS of the kernel we meant to build (tcgen05 MMAs, TMEM loads, TMA
loads and stores, no WGMMA, no spills, a finishing kernel exactly where it reduces, shuffles
exactly where it reduces columns), or is
refused with an UnsupportedError naming sm_100a and what it lacks.  These kernels are
compile-verified only: none has run on a Blackwell GPU."""

import re

import pytest

import coda_cute as cc
from coda_cute import library
from coda_cute.backends.registry import backend
from coda_cute.config import KernelConfig
from coda_cute.errors import UnsupportedError
from coda_cute.lower import lower
from coda_cute.render import emit
from coda_cute.runtime import runtime_defaults

BLACKWELL = KernelConfig(arch="sm_100a", gpu="B200", tile=(128, 256), cluster=(1, 1))
TILES = {"128x256": (128, 256), "128x128": (128, 128)}
# what this slice refuses, and the words its refusal names
REFUSED = {"qk_rmsnorm": "segment reductions"}
# random compositions (tests/random_programs.py) in the slice: N/2 and N outputs, row max,
# maxabs, logsumexp, sum and sumsq; N-wide tile inputs with column maxabs (0) and max (4), and
# a column max alone (17)
RANDOM_SEEDS = (7, 11, 13, 14, 52, 59, 0, 4, 17)


def _wide_output():
    @cc.epilogue
    def wide_output(acc, bias: cc.ColVec):
        """A 2N-wide output (16-bit words) beside an f32 one, and a row maximum."""
        y = acc + bias
        return {"D": cc.interleave(y, acc.row), "y32": y.to(cc.f32), "top": cc.row_max(y)}

    return wide_output


def _check_sass(name, program, compiled):
    sass = compiled.artifacts["sass"].read_text()
    ops = {op: len(re.findall(rf"\b{op}\b", sass))
           for op in ("UTCHMMA", "LDTM", "UTMALDG", "UTMASTG", "HGMMA", "SHFL")}
    assert ops["UTCHMMA"] > 0 and ops["LDTM"] > 0 and ops["UTMALDG"] > 0, f"{name}: {ops}"
    read = {node.attrs[0] for node in program.nodes if node.op == "load"}
    tile_inputs = [op for op in program.operands if op.kind == "tile" and op.name in read]
    assert ops["UTMALDG"] >= 2 + len(tile_inputs), f"{name}: a TMA load for A, B and each tile input: {ops}"
    col_reductions = [out for out in program.reductions if out.axis == "col"]
    assert (ops["SHFL"] > 0) == bool(col_reductions), f"{name}: shuffles exactly where it reduces columns: {ops}"
    assert ops["HGMMA"] == 0, f"{name}: Hopper's WGMMA in an sm_100a kernel"
    assert (ops["UTMASTG"] > 0) == bool(program.tile_outputs), f"{name}: TMA stores exactly where it stores tiles"
    assert compiled.spill_bytes == 0 and "LDL" not in sass and "STL" not in sass, f"{name}: spills"
    finish = re.search(r"\.text\.kernel_cutlass_finish", sass) is not None
    assert finish == bool(program.reductions), f"{name}: a finishing kernel exactly where it reduces"


@pytest.mark.compile
@pytest.mark.parametrize("tile", TILES)
@pytest.mark.parametrize("name", sorted(library.programs()))
def test_library_program_compiles_for_sm100_or_is_refused(name, tile, tmp_path):
    from coda_cute.compile import compile_program

    program = library.get(name)
    config = BLACKWELL.with_(tile=TILES[tile])
    if name in REFUSED:
        with pytest.raises(UnsupportedError, match=f"{REFUSED[name]} are not lowered to sm_100a"):
            lower(program, config)
        return
    compiled = compile_program(program, config, keep=("sass",), dump_dir=tmp_path / "dump",
                               source_dir=tmp_path / "src", report=True)
    _check_sass(name, program, compiled)


@pytest.mark.compile
@pytest.mark.parametrize("seed", RANDOM_SEEDS + ("wide_output",))
def test_random_compositions_compile_for_sm100(seed, tmp_path):
    from random_programs import random_program

    from coda_cute.compile import compile_program

    program = _wide_output() if seed == "wide_output" else random_program(seed)
    compiled = compile_program(program, BLACKWELL, keep=("sass",), dump_dir=tmp_path / "dump",
                               source_dir=tmp_path / "src", report=True)
    _check_sass(str(seed), program, compiled)


def test_sm100_refuses_what_this_slice_does_not_build():
    gemm = library.get("gemm")
    for config, words in ((BLACKWELL.with_(cluster=(2, 1)), "cluster 2x1 is not built for sm_100a"),
                          (BLACKWELL.with_(tile=(128, 192)), "tile 128x192 is not built for sm_100a"),
                          (BLACKWELL.with_(tile=(256, 128)), "tile 256x128 is not built for sm_100a"),
                          (BLACKWELL.with_(schedule="pingpong", tile=(128, 128)), "'pingpong' is not built for sm_100a")):
        with pytest.raises(UnsupportedError, match=words):
            lower(gemm, config)

    residual = library.get("residual_sumsq")
    with pytest.raises(UnsupportedError, match="in_stages 3: input rings must divide the tile's 8 subtiles"):
        lower(residual, BLACKWELL.with_(in_stages=3))
    with pytest.raises(UnsupportedError, match="in_stages 2: program 'gemm' has no tile inputs"):
        lower(gemm, BLACKWELL.with_(in_stages=2))
    with pytest.raises(UnsupportedError, match="8 mainloop stages do not fit"):
        lower(residual, BLACKWELL.with_(ab_stages=8))


def test_sm100_plans_input_rings_beside_the_mainloop_stages():
    """Input rings 4 deep where 4 mainloop stages still fit, else 2; the rest goes to the mainloop."""
    for name, tile, stages in (("residual_sumsq", (128, 256), (4, 2, 2)), ("residual_sumsq", (128, 128), (5, 2, 4)),
                               ("rmsnorm_bwd_residual", (128, 256), (3, 2, 2)),
                               ("swiglu_bwd_recompute", (128, 256), (3, 2, 2)), ("gemm", (128, 256), (4, 2, 0))):
        cfg = lower(library.get(name), BLACKWELL.with_(tile=tile)).cfg
        assert (cfg["ab_stages"], cfg["epi_stages"], cfg["in_stages"]) == stages, (name, tile)
    cfg = lower(library.get("residual_sumsq"), BLACKWELL.with_(in_stages=8)).cfg
    assert (cfg["in_stages"], cfg["ab_stages"]) == (8, 3)


@pytest.mark.compile
@pytest.mark.parametrize("tile", TILES)
@pytest.mark.parametrize("name,table_dtype", [("rope_qkv", "f32"), ("rms_rope_qkv", "bf16")])
def test_staged_tables_reach_smem_by_tma_on_sm100(name, table_dtype, tile, tmp_path):
    """stage_tables: the epilogue input warp brings each subtile's cos/sin slice into a ring by
    TMA, and the epilogue threads issue no global loads of their own for them (rms_rope_qkv's
    one is rstd's, a row vector)."""
    from coda_cute.compile import compile_program

    program = library.get(name)
    config = BLACKWELL.with_(tile=TILES[tile], table_periods=(("cos", 64), ("sin", 64)), stage_tables=True,
                             operand_dtypes=(("cos", table_dtype), ("sin", table_dtype)))
    source = emit(program, config)
    assert "in_cos__block" in source and "frag_table_cos" not in source and "EPI_LOAD_WARP = 6" in source
    compiled = compile_program(program, config, keep=("sass",), dump_dir=tmp_path / "dump",
                               source_dir=tmp_path / "src", report=True)
    _check_sass(name, program, compiled)
    sass = compiled.artifacts["sass"].read_text()
    assert sass.count("LDG.E") == (1 if name == "rms_rope_qkv" else 0), "global loads beside rstd's"
    assert len(re.findall(r"\bUTMALDG\b", sass)) >= 4, "TMA loads of A, B, cos and sin"


@pytest.mark.parametrize("kind", ["sum", "sumsq", "max", "maxabs"])
@pytest.mark.parametrize("offset", ["", "(TILE_THREADS // 32) * EPI_N"])
def test_the_column_exchange_sums_each_column_over_a_warp(kind, offset):
    """Run the generated lane exchange on CPU stand-ins: 128 threads in lockstep, each value a
    numpy array over the threads, shuffle_sync_bfly a permutation within each warp.  Thread t
    holds row t of a subtile, its value i column i; afterwards col_scratch[offset + 32 w + c]
    must hold warp w's total over its 32 rows of column c."""
    from types import SimpleNamespace

    import numpy as np

    lines = backend("sm_100a").column_exchange(kind, "red_x", 32, offset)
    code = "\n".join(line for line in lines if not line.lstrip().startswith("#"))
    threads, epi_n = 128, 32
    ctidx = np.arange(threads)
    values = np.random.default_rng(5).standard_normal((threads, epi_n))  # [row, column]
    namespace = dict(
        ctidx=ctidx, EPI_N=epi_n, TILE_THREADS=threads, red_x=[values[:, i].copy() for i in range(epi_n)],
        col_scratch=np.full(2 * threads, np.nan), where=np.where,
        cutlass=SimpleNamespace(range_constexpr=range),
        cute=SimpleNamespace(arch=SimpleNamespace(shuffle_sync_bfly=lambda x, offset: x[ctidx ^ offset]),
                             math=SimpleNamespace(max=np.maximum)),
    )
    exec(code, namespace)
    start = threads if offset else 0
    fold = {"sum": np.sum, "sumsq": np.sum, "max": np.max, "maxabs": np.max}[kind]
    for warp in range(threads // 32):
        expected = fold(values[32 * warp:32 * warp + 32], axis=0)
        got = namespace["col_scratch"][start + warp * epi_n:start + (warp + 1) * epi_n]
        np.testing.assert_allclose(got, expected, rtol=1e-12, err_msg=f"warp {warp}")


def test_an_sm100_config_needs_a_blackwell_gpu_and_hopper_keeps_its_defaults():
    assert KernelConfig().arch == "sm_90a" and KernelConfig().gpu == "H200"
    with pytest.raises(UnsupportedError, match="GPU 'H200' runs sm_90a kernels, not sm_100a.*B200, GB200"):
        KernelConfig(arch="sm_100a").check()
    with pytest.raises(UnsupportedError, match="GPU 'B200' runs sm_100a kernels, not sm_90a"):
        KernelConfig(gpu="B200").check()
    assert KernelConfig(arch="sm_100a", gpu="GB200").check().sm_count == 148
    assert backend("sm_100a").capability == (10, 0)
    # what emit and inspect build with no tile, cluster or schedule given
    assert runtime_defaults(library.get("gemm"), arch="sm_100a") == ((128, 256), (1, 1), "cooperative")


def test_a_hopper_gpu_is_refused_for_sm100_kernels(monkeypatch):
    """Kernels of sm_100a on a Hopper device: the call side's capability check refuses them."""
    import torch

    from coda_cute.runtime import gpu_model

    class Props:
        name, major, minor, multi_processor_count = "NVIDIA H200", 9, 0, 132

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Props())
    with pytest.raises(UnsupportedError, match="sm_90; coda-cute kernels target sm_100a"):
        gpu_model(torch.device("cuda"), "sm_100a")
    Props.name, Props.major, Props.minor, Props.multi_processor_count = "NVIDIA B200", 10, 0, 148
    assert gpu_model(torch.device("cuda"), "sm_100a") == "B200"


def test_the_emitted_sm100_module_reads_like_hopper_one():
    for name in ("gemm", "cross_entropy_stats_save", "swiglu_save", "rms_scale_gamma", "alpha_beta",
                 "rmsnorm_bwd_residual", "swiglu_bwd_recompute"):
        source = emit(library.get(name), BLACKWELL)
        assert all(len(line) <= 100 for line in source.splitlines()), name
        assert "--arch sm_100a --gpu B200" in source and "Compile-verified for sm_100a" in source
        assert "tcgen05" in source and "warpgroup" not in source
    row_sums = emit(library.get("cross_entropy_stats"), BLACKWELL)
    assert "shuffle" not in row_sums  # a thread holds whole rows: no exchange
    assert "part_lse[(0, tile_n, row)] = row_max" in row_sums
    # tile inputs: a seventh warp loads them; the epilogue waits for each subtile and frees it
    residual = emit(library.get("residual_sumsq"), BLACKWELL)
    assert "EPI_LOAD_WARP = 6" in residual and "NUM_THREADS = 32 * 7" in residual
    assert "epi_load_pipeline.consumer_wait(in_state)" in residual
    assert "epi_load_pipeline.consumer_release(in_state)" in residual
    assert "EPI_LOAD_WARP" not in emit(library.get("gemm"), BLACKWELL)
    dgamma = emit(library.get("rmsnorm_bwd"), BLACKWELL)
    assert "col_scratch[(ctidx // 32) * EPI_N + ctidx % 32] = red_dgamma[0]" in dgamma
    # gathered tables: one fragment entry per column pair of the row, loaded a subtile ahead
    rope = emit(library.get("rope_qkv"), BLACKWELL)
    assert "frag_table_cos = cute.make_rmem_tensor((EPI_N // 2,), cutlass.Float32)" in rope
    assert "v_cos = frag_table_cos[table_slot]" in rope and "gather_subtile = subtile + 1" in rope
    assert rope.index("gather_subtile = 0") < rope.index("acc_pipeline.consumer_wait(acc_state)")


def test_cli_emits_for_sm100(tmp_path, capsys):
    from coda_cute import cli

    out = tmp_path / "gemm.py"
    assert cli.main(["emit", "gemm", "--arch", "sm_100a", "--gpu", "B200", "-o", str(out)]) in (0, None)
    assert "cluster 1x1" in out.read_text() and "SM_COUNT = 148" in out.read_text()


@pytest.mark.compile
def test_fragment_mapping_matches_the_tmem_load_partition():
    """Thread t of the epilogue holds tile row t, its register i of subtile s column 32 s + i: what
    the template's pair loop assumes (pair0 = subtile * EPI_N + slot0, row = row0 + ctidx), as
    CuTe's partition of the tcgen05.ld 32x32b.x32 copy reports it at trace time."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.nvgpu import tcgen05
    import cutlass.utils.blackwell_helpers as sm100_utils
    from cutlass.cute.nvgpu import OperandMajorMode

    tile_m, tile_n, epi_n = 128, 256, 32
    found = []

    @cute.jit
    def probe():
        tiled_mma = sm100_utils.make_trivial_tiled_mma(
            cutlass.BFloat16, cutlass.BFloat16, OperandMajorMode.K, OperandMajorMode.K, cutlass.Float32,
            tcgen05.CtaGroup.ONE, (tile_m, tile_n))
        acc_shape = tiled_mma.partition_shape_C((tile_m, tile_n))
        layout = tiled_mma.make_fragment_C(acc_shape).layout
        from cutlass.utils.gemm.sm100 import transform_partitioned_tensor_layout

        tmem = cute.make_tensor(cute.make_ptr(cutlass.Float32, 0, cute.AddressSpace.tmem), layout)
        tAcc = transform_partitioned_tensor_layout(tmem)
        tAcc_epi = cute.flat_divide(tAcc, (tile_m, epi_n))
        atom = cute.make_copy_atom(tcgen05.Ld32x32bOp(tcgen05.Repetition(epi_n)), cutlass.Float32)
        t2r = tcgen05.make_tmem_copy(atom, tAcc_epi[(None, None, 0, 0)])
        subtiles = cute.flat_divide(cute.make_identity_tensor((tile_m, tile_n)), (tile_m, epi_n))
        for t in (0, 1, 31, 32, 77, 127):
            coords = t2r.get_slice(t).partition_D(subtiles)
            for s in (0, 3, 7):
                for i in (0, 1, 2, 17, 31):
                    found.append((t, s, i, coords[(None, None, None, 0, s)][i]))

    probe()
    assert found
    for t, s, i, (row, col) in found:
        assert (row, col) == (t, epi_n * s + i), (t, s, i, row, col)


def test_cli_builds_for_sm_100a_with_its_gpu_by_default(tmp_path, capsys, monkeypatch):
    """`--arch sm_100a` alone builds for a B200, in emit and precompile alike (--gpu names another)."""
    from coda_cute import cache
    from coda_cute.cli import main

    monkeypatch.setenv(cache.ENV_DIR, str(tmp_path / "cache"))
    assert main(["emit", "gemm", "--arch", "sm_100a", "-o", str(tmp_path / "gemm.py")]) == 0
    source = (tmp_path / "gemm.py").read_text()
    assert "--arch sm_100a --gpu B200" in source and "tcgen05" in source
    assert main(["precompile", "gemm", "--arch", "sm_100a", "--jobs", "1"]) == 0
    assert "B200" in capsys.readouterr().out
    assert main(["emit", "gemm", "--arch", "sm_100a", "--gpu", "H200"]) == 2
    assert "runs sm_90a kernels, not sm_100a" in capsys.readouterr().err


@cc.epilogue
def segment_mean(acc):
    """Each value less its 32-column segment's mean (a segment reduction)."""
    return acc - cc.row_sum(acc, segment=32) / 32.0


def test_kernel_takes_an_arch_and_checks_cpu_calls_against_its_kernel(gen, monkeypatch):
    """Kernel(program, arch="sm_100a") (or gpu="B200"): CPU calls run the reference and refuse
    what the sm_100a kernel cannot do; the device's arch is the default on the GPU."""
    import torch

    from coda_cute.runtime import Kernel, device_arch

    a, b = torch.randn(16, 64, generator=gen).bfloat16(), torch.randn(32, 64, generator=gen).bfloat16()
    for kernel in (Kernel(library.get("gemm"), arch="sm_100a"), Kernel(library.get("gemm"), gpu="B200")):
        torch.testing.assert_close(kernel(a, b).float(), (a.float() @ b.float().t()).bfloat16().float())
        assert (kernel.last.config.arch, kernel.last.config.gpu) == ("sm_100a", "B200")
    with pytest.raises(UnsupportedError, match="segment reductions are not lowered to sm_100a"):
        Kernel(segment_mean, arch="sm_100a")(a, b)
    with pytest.raises(UnsupportedError, match="runs sm_90a kernels, not sm_100a"):
        Kernel(library.get("gemm"), arch="sm_100a", gpu="H200")
    with pytest.raises(UnsupportedError, match="arch 'sm_99a' is not supported"):
        Kernel(library.get("gemm"), arch="sm_99a")

    class Props:
        name, major, minor, multi_processor_count = "NVIDIA B200", 10, 0, 148

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Props())
    assert device_arch(torch.device("cuda")) == "sm_100a"
    Props.major = 8
    with pytest.raises(UnsupportedError, match="sm_80; coda-cute kernels target sm_90a .*sm_100a"):
        device_arch(torch.device("cuda"))

"""Blackwell (sm_100a): every library program cross-compiles for sm_100a on this (GPU-less)
machine at both 1-CTA tiles and at the 2-CTA 256x128 tile, and a sample covering every
primitive at the other tile and cluster shapes, with the SASS of the kernel we meant to build
(tcgen05 MMAs, 2-CTA exactly where a CTA pair shares the MMA, multicast TMA loads exactly where
a 1-CTA cluster shares A or B, TMEM loads, TMA loads and stores, no WGMMA, no spills, a
finishing kernel exactly where it reduces, or with finish_in_gemm one kernel counting its tiles
in, shuffles exactly where it reduces columns); what
sm_100a does not build (other tiles and clusters, ping-pong) is refused with an
UnsupportedError naming sm_100a and what it lacks.  These kernels are compile-verified only:
none has run on a Blackwell GPU."""

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
PAIR = BLACKWELL.with_(tile=(256, 128), cluster=(2, 1))  # a CTA pair (cta_group 2)
# every library program compiles at every shape sm_100a builds: the 1-CTA tiles alone and in
# multicast clusters, and the CTA pairs
SHAPES = {"128x256": ((128, 256), (1, 1)), "128x128": ((128, 128), (1, 1)), "256x128-2x1": ((256, 128), (2, 1)),
          "256x256-2x1": ((256, 256), (2, 1)), "128x256-2x1": ((128, 256), (2, 1)),
          "128x256-1x2": ((128, 256), (1, 2)), "128x128-2x1": ((128, 128), (2, 1))}
# (program, tile, cluster) -> spilled bytes where a non-default shape spills (none does)
EXPECTED_SPILLS: dict = {}
# random compositions (tests/random_programs.py): N/2 and N outputs, row max, maxabs,
# logsumexp, sum and sumsq; N-wide tile inputs with column maxabs (0) and max (4), and a column
# max alone (17)
RANDOM_SEEDS = (7, 11, 13, 14, 52, 59, 0, 4, 17)
# ... and with extras: a table with a 128-column segment max (0) or sumsq (2), with 8-column
# sums (3) or a 16-column logsumexp (9); a table alone (7); a 32-column max alone (12)
EXTRAS_SEEDS = (0, 2, 3, 9, 7, 12)


def _wide_output():
    @cc.epilogue
    def wide_output(acc, bias: cc.ColVec):
        """A 2N-wide output (16-bit words) beside an f32 one, and a row maximum."""
        y = acc + bias
        return {"D": cc.interleave(y, acc.row), "y32": y.to(cc.f32), "top": cc.row_max(y)}

    return wide_output


def _check_sass(name, program, compiled, config=BLACKWELL):
    sass = compiled.artifacts["sass"].read_text()
    ops = {op: len(re.findall(rf"\b{op}\b", sass))
           for op in ("UTCHMMA", "LDTM", "UTMALDG", "UTMASTG", "HGMMA", "SHFL")}
    # a CTA pair's MMAs and A/B loads are cta_group 2 (UTCHMMA.2CTA, UTMALDG.2D.2CTA), and only
    # its; a 1-CTA cluster multicasts its A or B k-tiles (UTMALDG.2D.MULTICAST), and only it
    pair, clustered = config.tile[0] == 256, config.cluster != (1, 1)
    mmas = re.findall(r"\bUTCHMMA(?:\.\w+)*", sass)
    assert mmas and all(("2CTA" in op.split(".")) == pair for op in mmas), f"{name}: {sorted(set(mmas))}"
    pair_loads = re.findall(r"\bUTMALDG\.\w+\.2CTA\b", sass)
    assert (len(pair_loads) >= 2) == pair and (bool(pair_loads) == pair), f"{name}: A/B loads {pair_loads}"
    multicast = re.findall(r"\bUTMALDG(?:\.\w+)*\.MULTICAST\b", sass)
    assert bool(multicast) == (clustered and not pair), f"{name}: multicast loads {multicast}"
    assert ops["UTCHMMA"] > 0 and ops["LDTM"] > 0 and ops["UTMALDG"] > 0, f"{name}: {ops}"
    read = {node.attrs[0] for node in program.nodes if node.op == "load"}
    tile_inputs = [op for op in program.operands if op.kind == "tile" and op.name in read]
    assert ops["UTMALDG"] >= 2 + len(tile_inputs), f"{name}: a TMA load for A, B and each tile input: {ops}"
    col_reductions = [out for out in program.reductions if out.axis == "col"]
    # lane exchanges; SHFL.IDX also broadcasts a warp's aggregated atomic count (counting tiles in)
    exchanges = len(re.findall(r"\bSHFL\.(?!IDX)", sass))
    assert (exchanges > 0) == bool(col_reductions), f"{name}: shuffles exactly where it reduces columns: {ops}"
    assert ops["HGMMA"] == 0, f"{name}: Hopper's WGMMA in an sm_100a kernel"
    assert (ops["UTMASTG"] > 0) == bool(program.tile_outputs), f"{name}: TMA stores exactly where it stores tiles"
    spills = EXPECTED_SPILLS.get((name, tuple(config.tile), tuple(config.cluster)), 0)
    assert compiled.spill_bytes == spills, f"{name}: {compiled.spill_bytes} bytes spilled, expected {spills}"
    assert spills or ("LDL" not in sass and "STL" not in sass), f"{name}: spills"
    finish = re.search(r"\.text\.kernel_cutlass_finish", sass) is not None
    if config.finish_in_gemm:  # (set only where the program reduces: KernelConfig.resolved)
        from test_compile import counting_fences

        assert sass.count("//--------------------- .text.") == 1, f"{name}: one kernel (reductions are finished in it)"
        axes = len({o.axis for o in program.reductions})
        assert counting_fences(sass) == (2 * axes, 2 * axes), f"{name}: counting tiles in: {counting_fences(sass)}"
    else:
        assert finish == bool(program.reductions), f"{name}: a finishing kernel exactly where it reduces"


def _compile_and_check(name, program, config, tmp_path):
    from coda_cute.compile import compile_program

    compiled = compile_program(program, config, keep=("sass",), dump_dir=tmp_path / "dump",
                               source_dir=tmp_path / "src", report=True)
    _check_sass(name, program, compiled, config)
    return compiled


@pytest.mark.compile
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", sorted(library.programs()))
def test_library_program_compiles_for_sm100(name, shape, tmp_path):
    tile, cluster = SHAPES[shape]
    config = BLACKWELL.with_(tile=tile, cluster=cluster)
    if library.get(name).a_transform is not None:  # the LM head's backward GEMMs: sm_90a only, said so
        majors = "kn" if library.get(name).tokens_along == "row" else "mn"  # as the LM head passes them
        with pytest.raises(UnsupportedError, match="transforms A .* sm_100a kernels do not yet"):
            lower(library.get(name), config.with_(majors=majors))
        return
    _compile_and_check(name, library.get(name), config, tmp_path)


@pytest.mark.compile
@pytest.mark.parametrize("seed", RANDOM_SEEDS + tuple(f"{seed}_extras" for seed in EXTRAS_SEEDS) + ("wide_output",))
def test_random_compositions_compile_for_sm100(seed, tmp_path):
    from random_programs import random_program

    from coda_cute.compile import compile_program

    if seed == "wide_output":
        program = _wide_output()
    else:
        program = random_program(int(str(seed).split("_")[0]), extras=str(seed).endswith("_extras"))
    compiled = compile_program(program, BLACKWELL, keep=("sass",), dump_dir=tmp_path / "dump",
                               source_dir=tmp_path / "src", report=True)
    _check_sass(str(seed), program, compiled)


@pytest.mark.compile
@pytest.mark.parametrize("shape", [s for s in SHAPES if s not in ("128x256", "128x128")])
@pytest.mark.parametrize("seed", ("0", "0_extras", "wide_output"))
def test_random_compositions_compile_at_the_pair_and_cluster_shapes(seed, shape, tmp_path):
    """A tile input with a column maxabs (0), a table with a 128-column segment max (0 extras) and
    a 2N-wide output beside a row max, at each CTA-pair and multicast-cluster shape."""
    from random_programs import random_program

    program = _wide_output() if seed == "wide_output" else random_program(0, extras=seed.endswith("_extras"))
    tile, cluster = SHAPES[shape]
    _compile_and_check(seed, program, BLACKWELL.with_(tile=tile, cluster=cluster), tmp_path)


@pytest.mark.compile
@pytest.mark.parametrize("name,shape", [("rmsnorm_bwd", "128x256"), ("rmsnorm_bwd", "256x128-2x1"),
                                        ("cross_entropy_stats", "128x256")])
def test_reductions_finished_in_the_gemm_compile_for_sm100(name, shape, tmp_path):
    """finish_in_gemm (the runtime's choice for small calls): a row and a column reduction, a
    log-sum-exp, in a CTA's tiles and a CTA pair's."""
    tile, cluster = SHAPES[shape]
    config = BLACKWELL.with_(tile=tile, cluster=cluster, finish_in_gemm=True)
    _compile_and_check(name, library.get(name), config, tmp_path)


def test_sm100_refuses_what_it_does_not_build():
    gemm = library.get("gemm")
    for config, words in ((BLACKWELL.with_(tile=(128, 192)), "tile 128x192 is not built for sm_100a"),
                          (BLACKWELL.with_(tile=(256, 128)),
                           "cluster 1x1 is not built for sm_100a with tile 256x128 .*CTA pair.* use cluster 2x1"),
                          (PAIR.with_(cluster=(1, 2)), "cluster 1x2 is not built for sm_100a with tile 256x128"),
                          (BLACKWELL.with_(tile=(256, 256)), "cluster 1x1 is not built for sm_100a with tile 256x256"),
                          (BLACKWELL.with_(schedule="pingpong", tile=(128, 128)), "'pingpong' is not built for sm_100a")):
        with pytest.raises(UnsupportedError, match=words):
            lower(gemm, config)
    with pytest.raises(UnsupportedError, match="tile 256x256 is not built for sm_90a"):
        lower(gemm, KernelConfig(tile=(256, 256)))

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
    # a CTA pair: each CTA's stage holds its 128 rows of A and half of B's columns, so more fit
    for name, tile, stages in (("residual_sumsq", (256, 256), (5, 2, 4)), ("rmsnorm_bwd_residual", (256, 256), (4, 2, 4)),
                               ("swiglu_bwd_recompute", (256, 256), (4, 2, 2)), ("gemm", (256, 256), (6, 2, 0)),
                               ("gemm", (256, 128), (8, 2, 0))):
        cfg = lower(library.get(name), PAIR.with_(tile=tile)).cfg
        assert (cfg["ab_stages"], cfg["epi_stages"], cfg["in_stages"]) == stages, (name, tile)


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
                             math=SimpleNamespace(max=lambda x, y, propagate_nan: np.maximum(x, y))),
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
                 "rmsnorm_bwd_residual", "swiglu_bwd_recompute", "rope_qkv", "qk_rmsnorm"):
        for config in (BLACKWELL, PAIR, BLACKWELL.with_(cluster=(2, 1))):
            source = emit(library.get(name), config)
            assert all(len(line) <= 100 for line in source.splitlines()), name
            assert "--arch sm_100a --gpu B200" in source and "Compile-verified for sm_100a" in source
            assert "tcgen05" in source and "warpgroup" not in source
            # a cluster's CTAs find their place in it, and multicast exactly where one CTA per tile shares A or B
            assert ("cta_in_cluster" in source) == (config.cluster != (1, 1)), name
            assert ("mcast_mask=" in source) == (config.cluster != (1, 1)), name
            assert ("is_leader_cta" in source) == (config.tile[0] == 256), name
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
    # a 128-column segment (a head): reduced at its first subtile, its 4 subtiles re-read from TMEM
    heads = emit(library.get("qk_rmsnorm"), BLACKWELL)
    assert "if subtile % 4 == 0:" in heads and "seg_subtile = subtile + step % 4" in heads
    assert "seg0 = cute.make_rmem_tensor((1,), cutlass.Float32)" in heads and "= seg0[0]" in heads
    assert "shuffle" not in heads


def test_cli_emits_for_sm100(tmp_path, capsys):
    from coda_cute import cli

    out = tmp_path / "gemm.py"
    assert cli.main(["emit", "gemm", "--arch", "sm_100a", "--gpu", "B200", "-o", str(out)]) in (0, None)
    assert "cluster 1x1" in out.read_text() and "SM_COUNT = 148" in out.read_text()


@pytest.mark.compile
@pytest.mark.parametrize("mma_m,tile_n", [(128, 256), (256, 256), (256, 128)])
def test_fragment_mapping_matches_the_tmem_load_partition(mma_m, tile_n):
    """Thread t of a CTA's epilogue holds row t of the CTA's 128-row tile, its register i of
    subtile s column 32 s + i: what the template's pair loop assumes (pair0 = subtile * EPI_N +
    slot0, row = row0 + ctidx, row0 = tile_m * TILE_M).  CuTe's partition of the tcgen05.ld
    32x32b.x32 copy of the CTA's accumulator in TMEM, applied to the MMA tile's coordinates as
    the MMA partitions them for CTA v of the pair (v = 0 for a 1-CTA tile), reports row
    128 v + t at trace time: CTA v of a pair drains the MMA tile's rows [128 v, 128 v + 128),
    which is the scheduler's CTA tile 2 c + v of the pair's MMA tile c."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.nvgpu import tcgen05
    import cutlass.utils.blackwell_helpers as sm100_utils
    from cutlass.cute.nvgpu import OperandMajorMode
    from cutlass.utils.gemm.sm100 import transform_partitioned_tensor_layout

    rows, epi_n, pair = 128, 32, mma_m // 128
    ranks = tuple(range(pair))  # the CTAs of the pair: a Python loop at trace time
    found = []

    @cute.jit
    def probe():
        tiled_mma = sm100_utils.make_trivial_tiled_mma(
            cutlass.BFloat16, cutlass.BFloat16, OperandMajorMode.K, OperandMajorMode.K, cutlass.Float32,
            tcgen05.CtaGroup.TWO if pair == 2 else tcgen05.CtaGroup.ONE, (mma_m, tile_n))
        layout = tiled_mma.make_fragment_C(tiled_mma.partition_shape_C((mma_m, tile_n))).layout
        tmem = cute.make_tensor(cute.make_ptr(cutlass.Float32, 0, cute.AddressSpace.tmem), layout)
        tAcc_epi = cute.flat_divide(transform_partitioned_tensor_layout(tmem), (rows, epi_n))
        atom = cute.make_copy_atom(tcgen05.Ld32x32bOp(tcgen05.Repetition(epi_n)), cutlass.Float32)
        t2r = tcgen05.make_tmem_copy(atom, tAcc_epi[(None, None, 0, 0)])
        for v in ranks:
            coords = tiled_mma.get_slice(v).partition_C(cute.make_identity_tensor((mma_m, tile_n)))
            subtiles = cute.flat_divide(transform_partitioned_tensor_layout(coords), (rows, epi_n))
            for t in (0, 1, 31, 32, 77, 127):
                held = t2r.get_slice(t).partition_D(subtiles)
                for s in (0, 3, tile_n // epi_n - 1):
                    for i in (0, 1, 2, 17, 31):
                        found.append((v, t, s, i, held[(None, None, None, 0, s)][i]))

    probe()
    assert len(found) == pair * 6 * 3 * 5
    for v, t, s, i, (row, col) in found:
        assert (row, col) == (rows * v + t, epi_n * s + i), (v, t, s, i, row, col)


def test_a_cta_pair_indexes_its_partials_by_its_128_row_tile():
    """At 256-row tiles each CTA of the pair drains 128 rows: the emitted TILE_M is 128 (the
    scheduler counts tiles of it; MMA_TILE_M is the pair's 256), a column reduction writes the
    partial of CTA tile tile_m (guarded past M), a row reduction its row's (guarded past M and
    N), and the signature sizes the partials ceil(M / 128) along M, as the call (runtime) and the
    reference allocate them."""
    from coda_cute.backends.registry import backend as backend_of
    from coda_cute.signature import host_arguments

    for name, tile in (("rmsnorm_bwd", (256, 128)), ("cross_entropy_stats", (256, 256))):
        program, config = library.get(name), PAIR.with_(tile=tile)
        source = emit(program, config)
        assert f"TILE_M, TILE_N, TILE_K = 128, {tile[1]}, 64" in source and "MMA_TILE_M = CTA_GROUP * TILE_M" in source
        assert "CTA_GROUP = 2" in source and "tcgen05.CtaGroup.TWO" in source and "is_two_cta=True" in source
        assert "tiles_mn = (cute.ceil_div(mA.shape[0], TILE_M)" in source
        assert "tAgA[(None, tile_m // CTA_GROUP, None)]" in source and "row0 = tile_m * TILE_M" in source
        tile_rows = backend_of("sm_100a").cta_tile(config.tile)
        assert tile_rows == (128, tile[1])
        for arg in host_arguments(program, config):
            if arg.role == "partials":
                lead = (2,) if arg.dims[0] == 2 else ()
                along = (-(-200 // tile[1]), 300) if arg.dims[-1] == "M" else (-(-300 // 128), 200)
                assert arg.shape(300, 200, 64, tile_rows) == (*lead, *along), arg.name
    dgamma = emit(library.get("rmsnorm_bwd"), PAIR)
    assert "if global_col < N and row0 < M:" in dgamma and "part_dgamma[(tile_m, global_col)] = total" in dgamma
    stats = emit(library.get("cross_entropy_stats"), PAIR)
    assert "if row < M and col0 < N:" in stats and "part_lse[(0, tile_n, row)] = row_max" in stats


def test_a_cta_pair_call_allocates_partials_per_128_row_tile(gen):
    """The runtime's call plan and the reference's partials of a 256x128 sm_100a kernel: one per
    128-row CTA tile along M."""
    from test_signature import _inputs

    from coda_cute.arguments import bind
    from coda_cute.runtime import CallPlan, Kernel

    program = library.get("rmsnorm_bwd")
    m, n, k = 300, 64, 32
    a, b, operands = _inputs(program, m, n, k, gen)
    plan = CallPlan.build(program, bind(program, a, b, operands), PAIR, None, "key")
    assert dict(plan.partials)["dgamma"] == (3, n)  # ceil(300 / 128)
    _, partials = Kernel(program, arch="sm_100a", tile=(256, 128))(a, b, return_partials=True, **operands)
    assert tuple(partials["dgamma"].shape) == (3, n)


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
    # a CTA pair: its cluster given, or filled (2x1)
    for cluster in (["--cluster", "2x1"], []):
        out = tmp_path / "pair.py"
        assert main(["emit", "gemm", "--arch", "sm_100a", "--tile", "256x128", *cluster, "-o", str(out)]) == 0
        assert "CTA_GROUP = 2" in out.read_text() and "cluster 2x1" in out.read_text()
    assert main(["precompile", "gemm", "--arch", "sm_100a", "--tile", "256x128", "--cluster", "2x1",
                 "--jobs", "1"]) == 0
    assert main(["emit", "gemm", "--arch", "sm_100a", "--tile", "256x128", "--cluster", "1x2"]) == 2
    assert "cluster 1x2 is not built for sm_100a with tile 256x128" in capsys.readouterr().err


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
    acc = a.float() @ b.float().t()
    expected = acc - acc.reshape(16, 1, 32).sum(-1, keepdim=True).reshape(16, 1).repeat_interleave(32, 1) / 32.0
    torch.testing.assert_close(Kernel(segment_mean, arch="sm_100a")(a, b).float(), expected.bfloat16().float())
    with pytest.raises(UnsupportedError, match="'pingpong' is not built for sm_100a"):
        Kernel(library.get("gemm"), arch="sm_100a", tile=(128, 128), cluster=(1, 1), schedule="pingpong")(a, b)
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


class _Registers:
    """A thread's register tensor, for all 128 threads at once: entry i is an array over the
    threads (cute.make_rmem_tensor on the CPU stand-ins)."""

    def __init__(self, size):
        import numpy as np

        self.values = [np.zeros(128) for _ in range(size)]

    def __getitem__(self, i):
        return self.values[i]

    def __setitem__(self, i, value):
        self.values[i] = value

    def fill(self, value):
        import numpy as np

        self.values = [np.full(128, float(value)) for _ in self.values]


def _segment_program(kind, segment, paired):
    reduce = {"sum": cc.row_sum, "sumsq": cc.row_sumsq, "max": cc.row_max, "maxabs": cc.row_maxabs,
              "logsumexp": cc.row_logsumexp}[kind]

    @cc.epilogue
    def segments(acc):
        """One segment reduction, stored as it reads at each pair."""
        x = acc
        if paired:  # an N/2-wide value: a segment of `segment` of them spans twice as many columns
            x0, x1 = cc.pairs(acc)
            x = x0 * x1
        return {"D": reduce(x, segment=segment).to(cc.f32), "E": x.to(cc.f32)}  # E: acc after the pass

    return segments


@pytest.mark.parametrize("kind,segment,paired", [
    ("sumsq", 128, False), ("sum", 32, False), ("max", 16, False), ("maxabs", 8, False),
    ("logsumexp", 64, False), ("sum", 64, True), ("logsumexp", 8, True)])
@pytest.mark.parametrize("tile", [*TILES, "256x128-2x1"])
def test_the_segment_reductions_equal_the_reference_when_run_on_cpu_stand_ins(kind, segment, paired, tile):
    """Run a segment reduction's lines as generated for sm_100a (the tile's declarations, the
    subtile's pass with its TMEM re-reads, the pair loop's lookup and store) on CPU stand-ins: 128
    threads in lockstep, each register an array over the threads, tcgen05.ld a copy of subtile s
    of a random accumulator (thread t row t, register i column 32 s + i) into `acc`.  What the
    pair loop stores must equal the reference interpreter's value of the reduction."""
    from types import SimpleNamespace

    import numpy as np
    import torch

    from coda_cute.reference import evaluate_accumulator

    program = _segment_program(kind, segment, paired)
    config = PAIR if tile == "256x128-2x1" else BLACKWELL.with_(tile=TILES[tile])
    ctx = lower(program, config)
    source = emit(program, config)
    helpers = "\n".join(re.findall(r"^def (?:where|logsumexp_\w+)\(.*?(?=^\S)", source, re.M | re.S))
    tile_m, tile_n = backend("sm_100a").cta_tile(config.tile)  # one CTA's rows: a pair's CTA drains 128
    epi_n, threads = ctx.epi_n, 128
    accumulator = np.random.default_rng(segment).standard_normal((tile_m, tile_n))
    stored = {name: np.full((tile_m, tile_n), np.nan) for name in "DE"}

    class Copy:  # the TMEM tensor's subtile s, loaded into the registers as tcgen05.ld lays them out
        def __getitem__(self, coords):
            return coords[4]

    def copy(atom, subtile, registers):
        for i in range(epi_n):
            registers[i] = accumulator[:, epi_n * subtile + i].copy()

    class Stored:  # view_out_X: this thread's row of output X's stage for the subtile, by its column
        def __init__(self, name):
            self.name = name

        def __setitem__(self, col, value):
            col += epi_n * namespace["subtile"]  # the tile's accumulator column (N/2: c // 2)
            stored[self.name][:, col // 2 if paired else col] = value

    math = SimpleNamespace(max=lambda x, y, propagate_nan=False: np.maximum(x, y), abs=np.abs,
                           exp=lambda x, fastmath=False: np.exp(x), log=lambda x, fastmath=False: np.log(x))
    namespace = dict(
        EPI_N=epi_n, TILE_N=tile_n, EPI_SUBTILES=tile_n // epi_n, ctidx=np.arange(threads), row0=0, col0=0, M=tile_m,
        N=tile_n, t2r=None, tTR_tAcc=Copy(), acc_state=SimpleNamespace(index=0), acc=_Registers(epi_n),
        view_out_D=Stored("D"), view_out_E=Stored("E"),
        cutlass=SimpleNamespace(range=lambda *a, unroll=1: range(*a), range_constexpr=range, Float32=lambda x: x,
                                select_=np.where),
        cute=SimpleNamespace(copy=copy, make_rmem_tensor=lambda shape, dtype: _Registers(shape[0]), math=math,
                             arch=SimpleNamespace(fence_view_async_tmem_load=lambda: None)),
    )
    exec(helpers, namespace)
    assert ctx.subtile_segments and not any("shuffle" in line for line in ctx.subtile_segments)
    code = lambda lines: compile("\n".join(lines), "epilogue", "exec")  # noqa: E731
    prologue, segments = code(ctx.tile_prologue), code(ctx.subtile_segments)
    pair_loop = code(["slot0, slot1 = 2 * k, 2 * k + 1", "pair0 = subtile * EPI_N + slot0", "pair1 = pair0 + 1",
                      *ctx.body])
    exec(prologue, namespace)
    for subtile in range(tile_n // epi_n):
        namespace["subtile"] = subtile
        copy(None, subtile, namespace["acc"])  # the subtile's own TMEM load
        exec(segments, namespace)
        for k in range(epi_n // 2):
            namespace["k"] = k
            exec(pair_loop, namespace)
    expected = evaluate_accumulator(program, torch.from_numpy(accumulator).float()).outputs
    width = tile_n // 2 if paired else tile_n
    for name in "DE":
        assert not np.isnan(stored[name][:, :width]).any(), f"{name}: columns never stored"
        np.testing.assert_allclose(stored[name][:, :width], expected[name].double().numpy(), rtol=1e-5, atol=1e-5,
                                   err_msg=name)


@cc.epilogue
def row_reductions(acc, bias: cc.ColVec):
    """Every row reduction kind over a biased accumulator, beside a stored tile."""
    y = acc + bias
    return {"D": y, "s": cc.row_sumsq(y), "m": cc.row_max(y), "a": cc.row_maxabs(y), "l": cc.row_logsumexp(y)}


@pytest.mark.parametrize("tile", [*TILES, "256x128-2x1"])
def test_the_row_reductions_equal_the_reference_when_run_on_cpu_stand_ins(tile):
    """Run a program's row reductions as generated for sm_100a (the tile's registers, each pair's
    fold, the tile's partial write) thread by thread on the CPU: thread t holds row t and each
    subtile's 32 columns as tcgen05.ld leaves them, columns past N zero as TMA fills them.  With
    one tile along N, each thread's partial must equal the reference's reduction of its row over
    the first N columns (log-sum-exp: max + log of the sum of exponentials)."""
    from types import SimpleNamespace

    import numpy as np
    import torch

    from coda_cute.reference import evaluate_accumulator

    config = PAIR if tile == "256x128-2x1" else BLACKWELL.with_(tile=TILES[tile])
    ctx = lower(row_reductions, config)
    source = emit(row_reductions, config)
    helpers = "\n".join(re.findall(r"^def (?:where|logsumexp_\w+)\(.*?(?=^\S)", source, re.M | re.S))
    tile_m, tile_n = backend("sm_100a").cta_tile(config.tile)
    epi_n, n = ctx.epi_n, tile_n - 37  # a ragged last tile: columns past N must not count
    rng = np.random.default_rng(tile_n)
    accumulator, bias = rng.standard_normal((tile_m, tile_n)), rng.standard_normal(tile_n)
    accumulator[:, n:], bias[n:] = 0.0, 0.0  # zero-filled by TMA beyond N
    parts = {name: {} for name in "smal"}

    class Partials:
        def __init__(self, name):
            self.name = name

        def __setitem__(self, index, value):
            parts[self.name][index] = value

    class Scalars:  # a thread's register tensor
        def __init__(self, size):
            self.values = [0.0] * size

        def __getitem__(self, i):
            return self.values[i]

        def __setitem__(self, i, value):
            self.values[i] = value

        def fill(self, value):
            self.values = [value] * len(self.values)

    math = SimpleNamespace(max=lambda x, y, propagate_nan=False: max(x, y), abs=abs,
                           exp=lambda x, fastmath=False: float(np.exp(x)),
                           log=lambda x, fastmath=False: float(np.log(x)))
    code = lambda lines: compile("\n".join(lines), "epilogue", "exec")  # noqa: E731
    prologue, epilogue = code(ctx.tile_prologue), code(ctx.tile_epilogue)
    pair_loop = code(["slot0, slot1 = 2 * k, 2 * k + 1", "pair0 = subtile * EPI_N + slot0", "pair1 = pair0 + 1",
                      *ctx.body])
    for thread in range(tile_m):
        namespace = dict(
            EPI_N=epi_n, ctidx=thread, row0=0, col0=0, tile_n=0, M=tile_m, N=n, acc=Scalars(epi_n),
            frag_out_D=Scalars(epi_n), view_in_bias=bias,
            part_s=Partials("s"), part_m=Partials("m"), part_a=Partials("a"), part_l=Partials("l"),
            cutlass=SimpleNamespace(Float32=float, BFloat16=float, range_constexpr=range,
                                    select_=lambda cond, a, b: a if cond else b),
            cute=SimpleNamespace(make_rmem_tensor=lambda shape, dtype: Scalars(shape[0]), math=math))
        exec(helpers, namespace)
        exec(prologue, namespace)
        for subtile in range(tile_n // epi_n):
            namespace["subtile"] = subtile
            namespace["acc"].values = list(accumulator[thread, epi_n * subtile:epi_n * (subtile + 1)])
            for k in range(epi_n // 2):
                namespace["k"] = k
                exec(pair_loop, namespace)
        exec(epilogue, namespace)
    want = evaluate_accumulator(row_reductions, torch.from_numpy(accumulator[:, :n]).float(),
                                {"bias": torch.from_numpy(bias[:n]).float()}).outputs
    rows = range(tile_m)
    for name in "sma":
        got = np.array([parts[name][(0, row)] for row in rows])
        np.testing.assert_allclose(got, want[name].double().numpy(), rtol=1e-5, atol=1e-5, err_msg=name)
    lse = np.array([parts["l"][(0, 0, row)] + np.log(parts["l"][(1, 0, row)]) for row in rows])
    np.testing.assert_allclose(lse, want["l"].double().numpy(), rtol=1e-5, atol=1e-5, err_msg="l")

"""The runtime's call plans on the CPU: argument order and shapes handed to the kernel,
output allocation, finishing of reductions, and which calls share a plan.  (The kernel
itself is replaced by a stand-in that computes the program with the reference; the GPU
tests run the real one.)"""

import pytest
import torch

import coda_cute as cc
from coda_cute import library, reference
from coda_cute.arguments import bind
from coda_cute.config import DEFAULT_SWIZZLE, KernelConfig
from coda_cute.errors import UnsupportedError
from coda_cute.lower import lower
from coda_cute.runtime import CallPlan, Kernel, _heavy_because, _signature, runtime_defaults


def _stand_in(program, tile, finish_in_gemm=False):
    """A 'kernel' writing what the generated one writes: outputs, per-tile partials and their
    finished values (with ``finish_in_gemm``, taking the arrival counters, which it leaves zero)."""
    calls = []

    def launch(*args):
        calls.append([tuple(a.shape) if isinstance(a, torch.Tensor) else a for a in args])
        a, b = args[0], args[1]
        rest = list(args[2:])
        outs = [rest.pop(0) for _ in program.tile_outputs]
        reductions = [(rest.pop(0), rest.pop(0)) for _ in program.reductions]  # (partials, finished)
        if finish_in_gemm:
            arrivals = rest.pop(0)
            assert arrivals.dtype == torch.int32 and not arrivals.any()
        operands = {op.name: rest.pop(0) for op in program.operands}
        ref = reference.evaluate(program, a, b, operands, tile=tile)
        for o, t in zip(program.tile_outputs, outs):
            t.copy_(ref.outputs[o.name])
        for o, (parts, finished) in zip(program.reductions, reductions):
            parts.copy_(ref.partials[o.name])
            finished.copy_(reference.finish(o.reduce, parts))

    return launch, calls


def test_plan_passes_the_host_functions_arguments_and_finishes_reductions():
    program = library.get("residual_sumsq")
    config = KernelConfig(tile=(128, 256))
    a = torch.randn(2, 150, 64, dtype=torch.bfloat16)  # batch dims flattened into M = 300
    b = torch.randn(272, 64, dtype=torch.bfloat16)
    residual = torch.randn(2, 150, 272, dtype=torch.bfloat16)
    launch, calls = _stand_in(program, config.tile)
    plan = CallPlan.build(program, bind(program, a, b, {"residual": residual}), config, launch, "key")
    outputs = plan.run(a, b, {"residual": residual}, None, return_partials=False)
    assert calls == [[(300, 64), (272, 64), (300, 272), (2, 300), (300,), (300, 272)]]
    want = cc.evaluate(program, a, b, {"residual": residual})
    assert outputs["D"].shape == (2, 150, 272) and outputs["sumsq"].shape == (2, 150)
    torch.testing.assert_close(outputs["D"], want.outputs["D"], rtol=0, atol=0)
    torch.testing.assert_close(outputs["sumsq"], want.outputs["sumsq"], rtol=1e-5, atol=1e-4)


def test_plan_passes_arrival_counters_where_the_gemm_finishes_reductions():
    """finish_in_gemm: the counters (a tile row each, then a tile column each) follow the
    reductions, zeroed once and kept with the plan's partials for its next calls."""
    program = library.get("residual_sumsq")
    config = KernelConfig(tile=(128, 256), finish_in_gemm=True)
    a, b = torch.randn(300, 64, dtype=torch.bfloat16), torch.randn(272, 64, dtype=torch.bfloat16)
    residual = torch.randn(300, 272, dtype=torch.bfloat16)
    launch, calls = _stand_in(program, config.tile, finish_in_gemm=True)
    plan = CallPlan.build(program, bind(program, a, b, {"residual": residual}), config, launch, "key")
    plan.run(a, b, {"residual": residual}, None, return_partials=False)
    outputs = plan.run(a, b, {"residual": residual}, None, return_partials=False)
    # 3 tile rows and 2 tile columns
    assert calls[1] == [(300, 64), (272, 64), (300, 272), (2, 300), (300,), (5,), (300, 272)]
    torch.testing.assert_close(outputs["sumsq"], cc.evaluate(program, a, b, {"residual": residual}).outputs["sumsq"],
                               rtol=1e-5, atol=1e-4)


def test_small_calls_finish_their_reductions_in_the_gemm():
    """host_bound: a call whose GEMM and traffic would take under 10 us at the GPU's peak rates
    folds its reductions in the GEMM; a larger one (by FLOPs, or by the bytes of a shallow K)
    runs the finishing kernel; finish_in_gemm=True or False fixes it; programs without
    reductions never carry it."""
    program = library.get("residual_sumsq")

    def config(m, n, k, **kwargs):
        a, b = torch.empty(m, k, dtype=torch.bfloat16), torch.empty(n, k, dtype=torch.bfloat16)
        return Kernel(program, **kwargs).config_for(bind(program, a, b, {"residual": torch.empty(m, n, dtype=a.dtype)}))

    assert config(128, 128, 128).finish_in_gemm and config(1024, 2048, 2048).finish_in_gemm
    assert not config(8192, 2048, 2048).finish_in_gemm  # 69 GFLOP: 70 us at 989 TFLOP/s
    assert not config(8192, 8192, 64).finish_in_gemm  # 8.6 GFLOP, but 268 MB of residual and output
    assert not config(128, 128, 128, finish_in_gemm=False).finish_in_gemm
    assert config(8192, 2048, 2048, finish_in_gemm=True).finish_in_gemm
    plain = library.get("bias_gelu")
    a, b = torch.empty(128, 128, dtype=torch.bfloat16), torch.empty(128, 128, dtype=torch.bfloat16)
    assert not Kernel(plain, finish_in_gemm=True).config_for(bind(plain, a, b, {"bias": torch.empty(128)})).finish_in_gemm
    with pytest.raises(UnsupportedError, match="finish_in_gemm and unroll_subtiles must be None, True or False"):
        Kernel(program, finish_in_gemm="yes")


def _tile_operand_call_config(program, m, n, k, **kwargs):
    """Kernel(program, **kwargs)'s config for an M x N x K call of a program whose operands are
    all tiles (empty CPU tensors)."""
    a, b = torch.empty(m, k, dtype=torch.bfloat16), torch.empty(n, k, dtype=torch.bfloat16)
    operands = {op.name: torch.empty(m, int(n * op.width), dtype=a.dtype) for op in program.operands}
    return Kernel(program, **kwargs).config_for(bind(program, a, b, operands))


def test_ping_pong_kernels_of_large_calls_unroll_their_subtile_loop_while_tracing():
    """config.unrolled_subtiles: ping-pong kernels of calls that keep the GPU busy unroll their
    epilogue's subtile loop while tracing; small (host-bound) calls and cooperative kernels leave
    it to LLVM; unroll_subtiles=True or False fixes it."""
    config = _tile_operand_call_config
    swiglu_bwd, swiglu = library.get("swiglu_bwd"), library.get("swiglu")
    large = config(swiglu_bwd, 8192, 4096, 4096)
    assert large.schedule == "pingpong" and large.unroll_subtiles
    small = config(swiglu_bwd, 128, 1024, 128, schedule="pingpong")
    assert small.schedule == "pingpong" and not small.unroll_subtiles
    assert not config(swiglu, 8192, 4096, 4096).unroll_subtiles  # cooperative
    assert not config(swiglu_bwd, 8192, 4096, 4096, unroll_subtiles=False).unroll_subtiles
    assert config(swiglu, 8192, 4096, 4096, unroll_subtiles=True).unroll_subtiles
    with pytest.raises(UnsupportedError, match="unroll_subtiles must be None, True or False"):
        Kernel(swiglu, unroll_subtiles=1)


def test_small_calls_run_cooperative_128x128():
    """SMALL_CALL_TILE: a call too small to keep the GPU busy runs cooperative 128x128, whatever
    the rules give its program's large calls; a tile, schedule or cluster given is kept, and
    sm_100a keeps its backend's defaults."""
    def config(program, m, n, k, **kwargs):
        c = _tile_operand_call_config(program, m, n, k, **kwargs)
        return c.tile, c.cluster, c.schedule

    for name in ("gemm", "swiglu_bwd", "residual_sumsq"):  # large calls: coop 128x256, ping-pong, coop
        program = library.get(name)
        assert config(program, 128, 1024, 128) == ((128, 128), (1, 2), "cooperative"), name
        assert config(program, 8192, 4096, 4096) == runtime_defaults(program), name
    swiglu_bwd = library.get("swiglu_bwd")
    assert config(swiglu_bwd, 128, 1024, 128, tile=(128, 256)) == ((128, 256), (1, 2), "cooperative")
    assert config(swiglu_bwd, 128, 1024, 128, schedule="pingpong")[1:] == ((1, 2), "pingpong")
    assert config(swiglu_bwd, 128, 1024, 128, cluster=(1, 1)) == ((128, 128), (1, 1), "cooperative")
    assert config(swiglu_bwd, 128, 1024, 128, arch="sm_100a")[0] == runtime_defaults(swiglu_bwd, arch="sm_100a")[0]


def test_plan_writes_into_caller_outputs_and_returns_partials():
    program = library.get("swiglu_save")
    config = KernelConfig(tile=(128, 128))
    a, b = torch.randn(64, 32, dtype=torch.bfloat16), torch.randn(48, 32, dtype=torch.bfloat16)
    buffer = torch.zeros(64, 40, dtype=torch.bfloat16)
    launch, _ = _stand_in(program, config.tile)
    plan = CallPlan.build(program, bind(program, a, b, {}), config, launch, "key")
    outputs, partials = plan.run(a, b, {}, {"D": buffer[:, 8:32]}, return_partials=True)
    assert partials == {}
    assert outputs["D"].data_ptr() == buffer[:, 8:32].data_ptr()
    assert (buffer[:, :8] == 0).all() and (buffer[:, 32:] == 0).all()
    torch.testing.assert_close(outputs["D"], cc.evaluate(program, a, b).outputs["D"], rtol=0, atol=0)


def test_signature_separates_what_changes_the_plan():
    a = torch.randn(64, 32)
    b = torch.randn(48, 32)
    base = _signature(a, b, {}, None)
    assert _signature(torch.randn(64, 32), torch.randn(48, 32), {}, None) == base  # new data, same plan
    assert _signature(a.t().contiguous().t(), b, {}, None) != base  # other strides
    assert _signature(a.bfloat16(), b, {}, None) != base
    assert _signature(a[:32], b, {}, None) != base
    assert _signature(a, b, {"bias": torch.randn(48)}, None) != base
    offset = torch.randn(64 * 32 + 1)[1:].view(64, 32)  # same shape and strides, pointer off by 4 bytes
    assert _signature(offset, b, {}, None) != base  # a misaligned tensor misses the plan


def test_cpu_tensors_run_the_reference():
    kernel = Kernel(library.get("bias_gelu"))
    a, b, bias = (torch.randn(*shape).bfloat16() for shape in ((10, 16), (24, 16), (24,)))
    out = kernel(a, b, bias=bias)
    assert kernel.last.path == "reference" and kernel.launches == 0 and kernel.last.config.tile == (128, 128)
    want = torch.nn.functional.gelu(a.float() @ b.float().t() + bias.float())
    torch.testing.assert_close(out, want.bfloat16(), rtol=0, atol=0)


def test_cpu_calls_refuse_what_the_gpu_refuses_unless_relaxed():
    """fp32 GEMM inputs and N = 383 (rows of 766 bytes) run on the reference but not in the
    kernel: a strict Kernel refuses them on the CPU too, with the GPU's messages."""
    program = library.get("bias_gelu")
    a, b, bias = torch.randn(10, 16), torch.randn(383, 16), torch.randn(383)
    with pytest.raises(cc.ArgumentError, match="A and B are torch.float32; the GPU kernels take bfloat16"):
        Kernel(program)(a, b, bias=bias)
    with pytest.raises(cc.ArgumentError, match="rows must be a multiple of 16 bytes for TMA stores"):
        Kernel(program)(a.bfloat16(), b.bfloat16(), bias=bias.bfloat16())
    relaxed = Kernel(program, strict=False)
    torch.testing.assert_close(relaxed(a, b, bias=bias), torch.nn.functional.gelu(a @ b.t() + bias))
    assert relaxed.last.path == "reference" and relaxed.last.config is None


@pytest.mark.parametrize("given,want", [
    ({}, ((128, 192), (1, 2), "pingpong")),  # swiglu_bwd: a heavy epilogue
    ({"schedule": "cooperative"}, ((128, 256), (1, 2), "cooperative")),
    ({"tile": (128, 192)}, ((128, 192), (1, 2), "cooperative")),
    ({"cluster": (2, 1)}, ((128, 192), (2, 1), "pingpong")),
    ({"tile": (64, 256), "schedule": "pingpong", "cluster": (1, 1)}, ((64, 256), (1, 1), "pingpong")),
])
def test_kernel_fills_only_what_the_caller_left_out(given, want):
    """A given schedule or cluster is kept when the tile is left to the defaults (both were
    replaced by the defaults before)."""
    program = library.get("swiglu_bwd")
    a, b = torch.randn(2048, 64, dtype=torch.bfloat16), torch.randn(3072, 64, dtype=torch.bfloat16)
    problem = bind(program, a, b, {"preact": torch.randn(2048, 6144, dtype=torch.bfloat16)})
    config = Kernel(program, gpu="H200", **given).config_for(problem)
    assert (config.tile, config.cluster, config.schedule) == want


@pytest.mark.parametrize("m,n,gpu,tile", [
    (8192, 2048, "H200", (128, 128)),  # 704 tiles of 128x192: 5.33 waves on 132 SMs, run as 6
    (4096, 4096, "H100", (128, 128)),
    (8192, 8192, "H200", (128, 192)),  # the MLP's SwiGLU backward at d = 2048: a tie by waves
    (8192, 16384, "H200", (128, 192)),
    (4096, 3072, "H200", (128, 192)),  # 512 tiles of 128x192: 3.9 waves on 132 SMs
    (4096, 3072, "H100-PCIe", (128, 128)),  # 4.5 waves on 114, run as 5; 768 of 128x128: 6.7, run as 7
])
def test_heavy_epilogue_tile_counts_waves(m, n, gpu, tile):
    """Ping-pong 128x192 for a heavy epilogue, unless 128x128's whole waves take clearly less
    time on the GPU's SMs (runtime._pingpong_tile), with the schedule left out or asked for."""
    program = library.get("swiglu_bwd")
    a, b = torch.empty(m, 64, dtype=torch.bfloat16), torch.empty(n, 64, dtype=torch.bfloat16)
    problem = bind(program, a, b, {"preact": torch.empty(m, 2 * n, dtype=torch.bfloat16)})
    for schedule in (None, "pingpong"):
        config = Kernel(program, gpu=gpu, schedule=schedule).config_for(problem)
        assert (config.tile, config.schedule) == (tile, "pingpong")


@pytest.mark.parametrize("name,schedule", [
    ("gemm", "cooperative"), ("swiglu", "cooperative"), ("residual_sumsq", "cooperative"),
    ("rmsnorm_bwd_residual", "cooperative"),  # 2N of outputs, but its epilogue waits on tile inputs
    # N/2 + N of stores per row: ping-pong up to K = 2048, and runtime_defaults is K = 4096's
    ("rms_swiglu_save", "cooperative"), ("swiglu_save", "cooperative"),
    ("swiglu_bwd", "pingpong"), ("rope_qkv", "pingpong"), ("qk_rmsnorm", "cooperative"),
    ("cross_entropy_stats", "pingpong"), ("cross_entropy_stats_save", "pingpong"),  # a row log-sum-exp
    ("cross_entropy_exp_save", "pingpong"),  # a row sum of exponentials
    ("cross_entropy_bwd", "cooperative"),  # exponentials too, no reduction; not measured on ping-pong
])
def test_default_schedule_per_program(name, schedule):
    """Ping-pong 128x192 where the epilogue is heavy (measured, benchmarks/results), else
    cooperative 128x256, for a large problem (K = 4096)."""
    assert runtime_defaults(library.get(name)) == (((128, 192) if schedule == "pingpong" else (128, 256)), (1, 2),
                                                   schedule)


@pytest.mark.parametrize("name,why", [
    ("swiglu_bwd", {"wide"}), ("rope_qkv", {"tables"}), ("rms_swiglu_save", {"stores"}),
    ("cross_entropy_exp_save", {"exponentials"}), ("gemm", set()), ("residual_sumsq", set()),
])
def test_heavy_epilogues_say_why(name, why):
    """The reason decides how deep a K keeps ping-pong (runtime._pingpong_max_k)."""
    assert _heavy_because(library.get(name)) == why


@pytest.mark.parametrize("name,k,schedule", [
    ("swiglu_bwd", 2048, "pingpong"), ("swiglu_bwd", 4096, "pingpong"), ("swiglu_bwd", 8192, "cooperative"),
    # heavy only by its stores (N/2 + N per row, no tile read): cooperative from K = 4096 on
    ("rms_swiglu_save", 2048, "pingpong"), ("rms_swiglu_save", 4096, "cooperative"),
    ("rms_swiglu_save", 8192, "cooperative"),
])
def test_heavy_epilogues_run_cooperative_at_a_deep_k(name, k, schedule):
    """A heavy epilogue runs ping-pong up to K = PINGPONG_MAX_K (PINGPONG_MAX_K_STORES where only
    its stores make it heavy) and cooperative 128x256 beyond, where the mainloop is long enough to
    hide it (Llama MLP steps and kernels, measured)."""
    program = library.get(name)
    a, b = torch.empty(8192, k, dtype=torch.bfloat16), torch.empty(16384, k, dtype=torch.bfloat16)
    operands = {"rstd": torch.empty(8192)} if name == "rms_swiglu_save" else \
        {"preact": torch.empty(8192, 2 * 16384, dtype=torch.bfloat16)}
    config = Kernel(program, gpu="H100").config_for(bind(program, a, b, operands))
    assert (config.tile, config.schedule) == (((128, 192) if schedule == "pingpong" else (128, 256)), schedule)


def test_row_exponentials_keep_ping_pong_at_a_deep_k():
    """The LM head's statistics keep ping-pong 128x192 beyond PINGPONG_MAX_K: their work per
    element does not shrink against the mainloop as K grows the way a wide tile's traffic does
    (measured at 8192 x 128256 x 8192)."""
    program = library.get("cross_entropy_exp_save")
    a, b = torch.empty(8192, 8192, dtype=torch.bfloat16), torch.empty(32768, 8192, dtype=torch.bfloat16)
    config = Kernel(program, gpu="H100").config_for(bind(program, a, b, {"shift": torch.empty(8192),
                                                                        "target": torch.empty(8192, dtype=torch.int32)}))
    assert (config.tile, config.schedule) == ((128, 192), "pingpong")


def test_kernel_passes_the_tile_order_and_checks_it():
    program = library.get("gemm")
    a, b = torch.randn(256, 64, dtype=torch.bfloat16), torch.randn(512, 64, dtype=torch.bfloat16)
    problem = bind(program, a, b, {})
    assert Kernel(program, gpu="H200").config_for(problem).key() != \
        Kernel(program, gpu="H200", swizzle=1).config_for(problem).key(), "the tile order is part of the cache key"
    assert Kernel(program, gpu="H200").config_for(problem).swizzle == DEFAULT_SWIZZLE
    config = Kernel(program, gpu="H200", raster_along_m=False, swizzle=4).config_for(problem)
    assert (config.raster_along_m, config.swizzle) == (False, 4)
    assert config.describe().endswith("raster along N, swizzle 4")
    with pytest.raises(UnsupportedError, match="swizzle 3: expected one of 1, 2, 4, 8"):
        Kernel(program, gpu="H200", swizzle=3).config_for(problem)


def test_tables_are_staged_wherever_they_allow_it():
    """By default tables reach smem by TMA wherever TMA can slice them, and are gathered
    otherwise; stage_tables=True requires it (a table that cannot be staged is refused, naming
    it, before anything compiles) and False always gathers."""
    program = library.get("rope_qkv")
    a, b = torch.randn(300, 64, dtype=torch.bfloat16), torch.randn(512, 64, dtype=torch.bfloat16)

    def config(cos, **kwargs):
        cos = torch.randn(*cos) if isinstance(cos, tuple) else cos
        tables = {"cos": cos, "sin": torch.randn(256, 64)}
        return Kernel(program, gpu="H200", **kwargs).config_for(bind(program, a, b, tables))

    staged = config((256, 64))
    assert staged.stage_tables and staged.describe().endswith("tables staged in smem")
    assert config((256, 64), stage_tables=True) == staged
    assert not config((256, 64), stage_tables=False).stage_tables
    gemm = library.get("gemm")  # no tables: nothing to stage, whatever was asked
    assert not Kernel(gemm, gpu="H200", stage_tables=True).config_for(bind(gemm, a, b, {})).stage_tables
    # rings the caller fixed that fit only beside gathered tables: gathered
    assert not config((256, 64), tile=(128, 256), ab_stages=4, epi_stages=8).stage_tables
    unaligned = torch.randn(256, 65)[:, :64]  # rows 260 bytes apart
    for cos, why in (((200, 64), r"table 'cos' is \(200, 64\); staged in smem .* multiple of the tile's 128"),
                     ((256, 48), "period that is a multiple of 32"),
                     (unaligned, r"table 'cos' \(strides \(65, 1\)\): .* 16-byte aligned rows")):
        assert not config(cos).stage_tables  # gathered
        with pytest.raises(cc.ArgumentError, match=why):
            config(cos, stage_tables=True)


def test_tables_read_by_segment_reductions_are_gathered():
    @cc.epilogue
    def segment_of_table(acc, t: cc.Table):
        return acc - cc.row_max(acc * t, segment=8)

    a, b = torch.randn(256, 64, dtype=torch.bfloat16), torch.randn(512, 64, dtype=torch.bfloat16)
    problem = bind(segment_of_table, a, b, {"t": torch.randn(256, 64)})
    assert not Kernel(segment_of_table, gpu="H200").config_for(problem).stage_tables
    with pytest.raises(cc.ArgumentError, match="table 't' is read by a segment reduction"):
        Kernel(segment_of_table, gpu="H200", stage_tables=True).config_for(problem)
    with pytest.raises(UnsupportedError, match=r"tables \['t'\]: a segment reduction .* cannot read a table staged"):
        lower(segment_of_table, KernelConfig(stage_tables=True, table_periods=(("t", 64),)))


def test_out_views_are_written_in_place_or_refused():
    """A 3-D view whose rows do not flatten in place would be copied (the kernel writing the
    copy): it is refused; one that flattens is written and returned as given."""
    program = library.get("gemm")
    kernel = Kernel(program)
    a, b = torch.randn(2, 8, 16).bfloat16(), torch.randn(24, 16).bfloat16()
    buffer = torch.zeros(8, 2, 32, dtype=torch.bfloat16)
    gapped = buffer.transpose(0, 1)[..., :24]  # (2, 8, 24): its two batches' rows are not evenly spaced
    with pytest.raises(cc.ArgumentError, match=r"cannot be written in place as \(16, 24\)"):
        kernel(a, b, out={"D": gapped})
    rows = torch.zeros(16, 32, dtype=torch.bfloat16)
    given = rows[:, :24].view(2, 8, 24)
    assert kernel(a, b, out={"D": given}) is given
    torch.testing.assert_close(given, cc.evaluate(program, a, b).outputs["D"], rtol=0, atol=0)
    assert (rows[:, 24:] == 0).all()


@pytest.mark.parametrize("given,message", [
    ({"D": torch.zeros(16, 24)}, r"out\['D'\] must be \(16, 24\) or \(2, 8, 24\) torch.bfloat16, got \(16, 24\) torch.float32"),
    ({"D": torch.zeros(8, 48, dtype=torch.bfloat16)}, r"got \(8, 48\) torch.bfloat16"),  # same element count
    ({"E": torch.zeros(16, 24, dtype=torch.bfloat16)}, r"out= names unknown output\(s\) \['E'\]"),
    ({"D": torch.zeros(16, 24, dtype=torch.bfloat16).requires_grad_()}, r"out\['D'\] requires grad"),
])
def test_out_is_checked_on_the_cpu_as_on_the_gpu(given, message):
    a, b = torch.randn(2, 8, 16).bfloat16(), torch.randn(24, 16).bfloat16()
    for strict in (True, False):
        with pytest.raises(cc.ArgumentError, match=message):
            Kernel(library.get("gemm"), strict=strict)(a, b, out=given)
    with pytest.raises(cc.ArgumentError, match=r"out\['sumsq'\]: reductions are returned"):
        Kernel(library.get("residual_sumsq"))(a, b, residual=torch.randn(2, 8, 24).bfloat16(),
                                              out={"sumsq": torch.zeros(16)})


def test_operands_may_share_names_with_the_calls_positional_arguments():
    @cc.epilogue
    def uses_call_names(acc, a: cc.ColVec, b: cc.RowVec, self: cc.Scalar):
        return acc * a + b * self

    x, w = torch.randn(16, 16).bfloat16(), torch.randn(24, 16).bfloat16()
    col, row = torch.randn(24).bfloat16(), torch.randn(16).bfloat16()
    out = Kernel(uses_call_names)(x, w, a=col, b=row, self=2.0)
    want = (x.float() @ w.float().t()) * col.float() + row.float()[:, None] * 2.0
    torch.testing.assert_close(out, want.bfloat16(), rtol=0, atol=0)
    for name in ("out", "return_partials"):
        namespace = {"cc": cc}
        exec(f"def p(acc, {name}: cc.ColVec):\n    return acc", namespace)  # noqa: S102 - the test's own text
        with pytest.raises(cc.ProgramError, match=f"operand name '{name}' is a keyword of the kernel call"):
            cc.epilogue(namespace["p"])

"""Generated kernels against the reference interpreter, on a Hopper GPU.

Every library program (and random compositions, see test_gpu_random.py) runs through
the generated sm_90a kernel and is compared element by element with the reference:
|out - ref| <= atol + rtol * |ref| per element and a relative-norm bound per output.
Outputs live inside larger NaN-poisoned buffers whose guard bands must stay untouched;
NaN left inside an output means an element was never written.  Each check asserts that
the kernel (not the CPU fallback) ran.
"""

from __future__ import annotations

import pytest
import torch

import coda_cute as cc
from coda_cute import library
from coda_cute.backends.registry import backend
from coda_cute.errors import UnsupportedError
from coda_cute.program import Program
from coda_cute.runtime import SMALL_CALL_TILE, Kernel


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")]

# (atol, rtol) per stored dtype: one rounding of the output plus fp32 accumulation-order noise.
TOLERANCE = {torch.bfloat16: (2e-2, 2e-2), torch.float16: (4e-3, 4e-3), torch.float32: (1e-3, 1e-3)}
# finished reductions are fp32 sums of up to N terms of size ~1
REDUCTION_TOLERANCE = (2e-3, 2e-3)
# (M, N, K): ragged against every tile, M != N, K down to 16, M = 1
SHAPES = [(300, 528, 200), (1, 272, 16), (1000, 784, 136), (129, 1040, 520)]
GUARD = 8  # poisoned rows/columns around every output


def make_inputs(program: Program, m: int, n: int, k: int, dtype, gen: torch.Generator, majors: str = "kk",
                table_rows: int = 37):
    """Random A, B and operands; distinct random vectors so a swapped broadcast shows up."""
    scale = k ** -0.25  # acc ~ N(0, 1)
    a = (torch.randn(m, k, generator=gen) * scale).to(dtype)
    b = (torch.randn(n, k, generator=gen) * scale).to(dtype)
    if majors[0] == "m":
        a = a.t().contiguous().t()
    if majors[1] == "n":
        b = b.t().contiguous().t()
    operands = {}
    for op in program.operands:
        cols = int(n * op.width) if op.width is not None else None
        if op.kind == "scalar":
            operands[op.name] = float(torch.rand((), generator=gen) + 0.5)
        elif op.kind == "row":
            operands[op.name] = torch.rand(m, generator=gen) + 0.5
        elif op.kind == "col":
            operands[op.name] = (torch.rand(cols, generator=gen) + 0.5).to(dtype)
        elif op.kind == "tile":
            operands[op.name] = torch.randn(m, cols, generator=gen).to(dtype)
        else:
            operands[op.name] = torch.randn(table_rows, 64, generator=gen)
    if "target" in operands:  # class indices for cross_entropy_*: int32 (what nn passes) or fp32, by seed
        target = torch.randint(0, n, (m,), generator=gen)
        operands["target"] = target.int() if (m + n) % 2 else target.float()
    return a.cuda(), b.cuda(), {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in operands.items()}


def poisoned_outputs(program: Program, m: int, n: int, dtype):
    """Each tile output as a view into a NaN-filled buffer with GUARD rows/cols around it."""
    views, buffers = {}, {}
    for out in program.tile_outputs:
        cols = int(n * out.node.width)
        out_dtype = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}.get(out.dtype, dtype)
        buf = torch.full((m + 2 * GUARD, cols + 2 * GUARD), float("nan"), dtype=out_dtype, device="cuda")
        buffers[out.name] = buf
        views[out.name] = buf[GUARD:GUARD + m, GUARD:GUARD + cols]
    return views, buffers


def check_guard(name: str, buf: torch.Tensor, m: int, cols: int):
    inside = torch.zeros_like(buf, dtype=torch.bool)
    inside[GUARD:GUARD + m, GUARD:GUARD + cols] = True
    assert torch.isnan(buf[~inside]).all(), f"{name}: the kernel wrote outside the output (guard band touched)"
    assert not torch.isnan(buf[inside]).any(), f"{name}: some output elements were never written"


def assert_close(name: str, got: torch.Tensor, want: torch.Tensor, atol: float, rtol: float):
    got, want = got.float(), want.float()
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    err = (got - want).abs()
    bad = err > atol + rtol * want.abs()
    if bad.any():
        idx = tuple(bad.nonzero()[0].tolist())
        pytest.fail(f"{name}: {int(bad.sum())} of {want.numel()} elements off; first at {idx}: "
                    f"got {got[idx].item():.6g}, want {want[idx].item():.6g}; max err {err.max().item():.3g}")
    rel = (got - want).norm() / want.norm().clamp_min(1e-12)
    assert rel < max(rtol, 1e-6), f"{name}: relative norm error {rel:.3g}"


def run_and_compare(program: Program, m: int, n: int, k: int, dtype=torch.bfloat16, majors="kk",
                    tile=None, cluster=None, schedule=None, seed=0, ab_stages=0, operand_dtypes=None, table_rows=37,
                    **order):
    gen = torch.Generator().manual_seed(seed * 7919 + m * 31 + n * 17 + k)
    a, b, operands = make_inputs(program, m, n, k, dtype, gen, majors, table_rows)
    for name, operand_dtype in (operand_dtypes or {}).items():
        operands[name] = operands[name].to(operand_dtype)
    kernel = Kernel(program, tile=tile, cluster=cluster, schedule=schedule, ab_stages=ab_stages, **order)
    views, buffers = poisoned_outputs(program, m, n, dtype)
    result = kernel(a, b, out=views, return_partials=True, **operands)
    torch.cuda.synchronize()
    assert kernel.last.path == "kernel" and kernel.launches == 1, "the generated kernel did not run"
    config = kernel.last.config
    cta_tile = backend(config.arch).cta_tile(config.tile)  # what partials and table row blocks count
    if any(op.kind == "table" for op in program.operands):  # staged by default where the tables allow it
        staged = order.get("stage_tables")
        staged = table_rows % cta_tile[0] == 0 if staged is None else staged
        assert config.stage_tables == staged
    outputs, partials = result
    ref = cc.evaluate(program, a, b, operands, tile=cta_tile)
    for out in program.tile_outputs:
        cols = int(n * out.node.width)
        check_guard(out.name, buffers[out.name], m, cols)
        atol, rtol = TOLERANCE[ref.outputs[out.name].dtype]
        assert_close(out.name, outputs[out.name], ref.outputs[out.name], atol, rtol)
    for out in program.reductions:
        atol, rtol = REDUCTION_TOLERANCE
        assert_close(f"{out.name} (partials)", partials[out.name], ref.partials[out.name], atol, rtol)
        assert_close(out.name, outputs[out.name], ref.outputs[out.name], atol, rtol)
    return config  # the configuration that ran


def _gpu_programs():
    names = []
    for name, program in library.programs().items():
        try:
            from coda_cute.config import KernelConfig
            from coda_cute.lower import lower

            lower(program, KernelConfig())
            names.append(name)
        except UnsupportedError:
            continue
    return names


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", _gpu_programs())
def test_library_program(name, shape):
    """At these small shapes calls are host-bound (runtime.host_bound): they run cooperative
    128x128 (runtime.SMALL_CALL_TILE) and finish reductions in the GEMM;
    test_library_program_finishing_kernel runs the second kernel."""
    config = run_and_compare(_sized(name, shape[1]), *shape)
    assert config.finish_in_gemm == bool(library.get(name).reductions)
    assert (config.tile, config.schedule) == SMALL_CALL_TILE


@pytest.mark.parametrize("name", [n for n in _gpu_programs() if library.get(n).reductions])
def test_library_program_finishing_kernel(name):
    config = run_and_compare(_sized(name, 784), 1000, 784, 136, finish_in_gemm=False)
    assert not config.finish_in_gemm


def _sized(name: str, n: int) -> Program:
    """Library program with constants that fit N: RoPE rotates part of the columns, heads divide N."""
    program = library.get(name)
    if name == "rope_qkv":  # rotate some columns, pass the rest through
        program = program.with_constants(rotary_cols=n // 2)
    if name == "qk_rmsnorm":
        program = program.with_constants(head_dim=16)
    return program


def test_qk_rmsnorm_llama_heads():
    run_and_compare(library.get("qk_rmsnorm"), 333, 768, 128)  # head_dim 128: two heads per 128x256 tile


@pytest.mark.parametrize("majors", ["kk", "mk", "kn", "mn"])
def test_majors(majors):
    run_and_compare(library.get("bias_gelu"), 304, 528, 200, majors=majors)  # M-major A needs M % 8 == 0


@pytest.mark.parametrize("tile,cluster,schedule", [
    ((128, 256), (2, 1), "cooperative"), ((128, 128), (1, 2), "cooperative"), ((64, 256), (1, 1), "cooperative"),
    ((128, 64), (2, 1), "cooperative"), ((64, 128), (1, 1), "cooperative"),
    ((64, 256), (2, 1), "pingpong"), ((64, 128), (1, 2), "pingpong"), ((64, 256), (1, 1), "pingpong"),
    ((128, 128), (1, 2), "pingpong"), ((128, 64), (2, 1), "pingpong"), ((128, 192), (1, 2), "pingpong"),
    ((128, 192), (2, 1), "cooperative"),
])
def test_tiles(tile, cluster, schedule):
    run_and_compare(library.get("residual_sumsq"), 777, 1040, 264, tile=tile, cluster=cluster, schedule=schedule)


@pytest.mark.parametrize("name", _gpu_programs())
def test_library_program_pingpong(name):
    program = _sized(name, 1040)
    tile = (64, 128) if any(o.node.width > 1 for o in program.tile_outputs) else (64, 256)
    run_and_compare(program, 700, 1040, 136, tile=tile, cluster=(2, 1), schedule="pingpong")


@pytest.mark.parametrize("name", _gpu_programs())
def test_library_program_pingpong_two_mma_blocks(name):
    """Ping-pong with 128-row tiles: each warpgroup holds two 64-row MMA blocks per thread."""
    run_and_compare(_sized(name, 1040), 700, 1040, 136, tile=(128, 128), cluster=(1, 2), schedule="pingpong")


@pytest.mark.parametrize("name", _gpu_programs())
def test_library_program_pingpong_128x192(name):
    """Ping-pong with 128x192 tiles: 192 accumulators per thread, N not a multiple of the tile."""
    run_and_compare(_sized(name, 1040), 700, 1040, 136, tile=(128, 192), cluster=(1, 2), schedule="pingpong")


@pytest.mark.parametrize("name", _gpu_programs())
def test_library_program_256_rows(name):
    """Cooperative 256x128 tiles: two warpgroups, each holding two 64-row MMA blocks per thread;
    M not a multiple of the tile."""
    run_and_compare(_sized(name, 1040), 700, 1040, 136, tile=(256, 128), cluster=(2, 1), schedule="cooperative")


@pytest.mark.parametrize("tile,cluster,schedule", [((128, 256), (2, 1), "cooperative"),
                                                   ((64, 256), (1, 2), "pingpong")])
@pytest.mark.parametrize("name", [n for n in _gpu_programs() if any(op.kind == "tile" for op in library.get(n).operands)])
def test_library_program_deep_input_rings(name, tile, cluster, schedule):
    """3 mainloop stages leave room for input rings several subtiles (up to a whole tile) deep."""
    run_and_compare(_sized(name, 1040), 700, 1040, 136, tile=tile, cluster=cluster, schedule=schedule, ab_stages=3)


@pytest.mark.parametrize("name,tile,cluster,schedule,raster_along_m,swizzle", [
    ("gemm", (128, 256), (1, 2), "cooperative", True, 1),
    ("gemm", (128, 256), (1, 2), "cooperative", True, 2),
    ("gemm", (128, 256), (1, 2), "cooperative", True, 4),
    ("gemm", (128, 256), (1, 2), "cooperative", False, 4),
    ("residual_sumsq", (128, 256), (1, 2), "cooperative", True, 4),
    ("residual_sumsq", (128, 256), (2, 1), "cooperative", False, 4),
    ("rmsnorm_bwd", (128, 256), (1, 2), "cooperative", True, 4),
    ("swiglu_bwd", (128, 192), (1, 2), "pingpong", True, 1),
    ("swiglu_bwd", (128, 192), (1, 2), "pingpong", True, 4),
    ("rope_qkv", (128, 192), (1, 2), "pingpong", True, 2),
])
def test_swizzled_tile_order(name, tile, cluster, schedule, raster_along_m, swizzle):
    """700 x 1040: 6 cluster rows and 3 cluster columns of 128x256 tiles in 1x2 clusters, so
    swizzle 4 walks one band narrower than 4 (raster N: a band of 4 rows and one of 2) and
    swizzle 2 a last band of one column (swizzle 1: CuTe's walk as it is); ragged edges on both
    sides; ping-pong's two warpgroups take alternate tiles of the regrouped walk."""
    run_and_compare(_sized(name, 1040), 700, 1040, 136, tile=tile, cluster=cluster, schedule=schedule,
                    raster_along_m=raster_along_m, swizzle=swizzle)


@pytest.mark.parametrize("name", ["swiglu_save", "residual_sumsq", "swiglu_bwd_recompute"])
def test_fp16_inputs(name):
    """f16 end to end; residual_sumsq rounds h mid-program (round_pair's cvt.rn.f16x2.f32), and
    swiglu_bwd_recompute's 2N-wide tiles move as 64-bit words of f16 (pack_quad / unpack_quad)."""
    run_and_compare(library.get(name), 300, 528, 200, dtype=torch.float16)


@pytest.mark.parametrize("schedule", ["cooperative", "pingpong"])
def test_fp32_wide_tile_input(schedule):
    """preact in fp32: a 2N-wide tile of 32-bit values keeps the per-element smem views (16-bit
    ones move as 64-bit words)."""
    tile = (128, 128) if schedule == "pingpong" else None
    run_and_compare(library.get("swiglu_bwd"), 300, 528, 200, tile=tile, schedule=schedule,
                    operand_dtypes={"preact": torch.float32})


def test_runs_on_current_stream():
    program = library.get("bias_gelu")
    gen = torch.Generator().manual_seed(5)
    a, b, ops = make_inputs(program, 512, 512, 256, torch.bfloat16, gen)
    stream = torch.cuda.Stream()
    kernel = Kernel(program)
    kernel(a, b, **ops)  # compile outside the stream
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(50_000_000)  # keeps the stream busy: a launch elsewhere would finish first
        out = kernel(a, b, **ops)
    assert not stream.query(), "the kernel did not wait behind the stream's earlier work"
    stream.synchronize()
    ref = cc.evaluate(program, a, b, ops).outputs["D"]
    assert_close("D", out, ref, *TOLERANCE[torch.bfloat16])


def test_second_call_reuses_the_plan_with_new_data():
    program = library.get("residual_sumsq")
    kernel = Kernel(program)
    gen = torch.Generator().manual_seed(11)
    for call in range(3):
        a, b, ops = make_inputs(program, 300, 528, 200, torch.bfloat16, gen)
        got = kernel(a, b, **ops)
        ref = cc.evaluate(program, a, b, ops)
        assert_close(f"D (call {call})", got["D"], ref.outputs["D"], *TOLERANCE[torch.bfloat16])
        assert_close(f"sumsq (call {call})", got["sumsq"], ref.outputs["sumsq"], *REDUCTION_TOLERANCE)
    assert kernel.launches == 3 and len(kernel._plans) == 1


def test_misaligned_pointer_is_rejected_on_a_warm_plan():
    program = library.get("gemm")
    kernel = Kernel(program)
    a = torch.randn(64, 72, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    kernel(a[:, :64], b)  # warm: a view with 16-byte aligned rows and base
    with pytest.raises(cc.ArgumentError, match="16-byte aligned"):
        kernel(a[:, 1:65], b)  # same shape and strides, base off by 2 bytes


@pytest.mark.parametrize("name", ["bias_gelu", "swiglu", "residual_sumsq", "rms_swiglu_save", "cross_entropy_stats"])
def test_derived_backward_program(name):
    """The kernel of a derived backward program (cc.derive), standing alone as a GEMM + epilogue:
    what bench_programs times and `coda-cute emit --backward` prints."""
    run_and_compare(cc.derive(library.get(name)).backward, 300, 528, 200)


@pytest.mark.parametrize("seed", range(24))
def test_random_composition(seed):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from random_programs import random_program

    tile, cluster, schedule = [((64, 256), (2, 1), "pingpong"), ((128, 128), (1, 2), "pingpong"),
                               (None, None, None)][seed % 3]
    run_and_compare(random_program(seed), 300, 528, 200, tile=tile, cluster=cluster, schedule=schedule, seed=seed)


def many_reductions(acc, bias: cc.ColVec):
    y = acc + bias
    return {"D": y, "total": cc.row_sum(y), "top": cc.col_max(y), "lse": cc.row_logsumexp(y),
            "peak": cc.row_maxabs(y), "energy": cc.col_sumsq(y)}


@pytest.mark.parametrize("in_gemm", [False, True], ids=["finishing_kernel", "in_gemm"])
@pytest.mark.parametrize("shape", [(4229, 8456, 64), (100, 200, 32)], ids=["34x34_tiles", "one_tile"])
def test_reductions_finished_over_many_tiles_and_one(shape, in_gemm):
    """The partials of every kind folded over 34 tiles and over a single tile: by the finishing
    kernel (34 is more than the 32 its CTA folds per round, so the round loop repeats and masks
    tiles past the last), or by the GEMM's last tile of each row or column of tiles (its loop of
    four loads at a time runs past its last full round).  The values are the same bits on every
    call, and the GEMM leaves its arrival counters at zero."""
    program = cc.epilogue(many_reductions)
    assert run_and_compare(program, *shape, finish_in_gemm=in_gemm).finish_in_gemm == in_gemm
    gen = torch.Generator().manual_seed(17)
    a, b, ops = make_inputs(program, *shape, torch.bfloat16, gen)
    kernel = Kernel(program, finish_in_gemm=in_gemm)
    first = kernel(a, b, **ops)
    again = kernel(a, b, **ops)
    for out in program.reductions:
        assert torch.equal(first[out.name], again[out.name]), f"{out.name}: not the same bits on a second call"
    (plan,) = kernel._plans.values()
    arrivals = plan.scratch()[1]
    assert (arrivals is not None) == in_gemm and not (in_gemm and arrivals.any()), "counters left set"


def test_names_that_extend_others_stay_apart():
    """Outputs D and D_tensor, operands x and x_part, reductions lse and lse_max: each its own
    value (lse's running max and output lse_max once shared one register tensor)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_compile import names_that_extend_others

    run_and_compare(cc.epilogue(names_that_extend_others), 300, 528, 200)


@pytest.mark.parametrize("in_gemm", [False, True], ids=["finishing_kernel", "in_gemm"])
def test_cuda_graph_capture_of_a_warm_kernel_and_refusal_when_cold(in_gemm):
    program = library.get("bias_gelu")
    gen = torch.Generator().manual_seed(3)
    a, b, ops = make_inputs(program, 256, 256, 128, torch.bfloat16, gen)
    warm = Kernel(program)
    warm(a, b, **ops)  # compiled, loaded and planned before capture
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph):
            captured = warm(a, b, **ops)
    a.copy_(torch.randn(a.shape, generator=gen).to(a))
    graph.replay()
    torch.cuda.synchronize()
    assert_close("D (graph replay)", captured, cc.evaluate(program, a, b, ops).outputs["D"], *TOLERANCE[torch.bfloat16])
    # a program with reductions: the finishing kernel's programmatic dependent launch is captured
    # too; or the GEMM's arrival counters are made (zeroed) in the graph, and each replay leaves
    # them zero for the next
    program = library.get("residual_sumsq")
    a, b, ops = make_inputs(program, 300, 528, 200, torch.bfloat16, gen)
    warm = Kernel(program, finish_in_gemm=in_gemm)
    warm(a, b, **ops)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph):
            captured = warm(a, b, **ops)
    ops["residual"].copy_(torch.randn(ops["residual"].shape, generator=gen).to(ops["residual"]))
    graph.replay()
    torch.cuda.synchronize()
    ref = cc.evaluate(program, a, b, ops).outputs
    assert_close("D (graph replay)", captured["D"], ref["D"], *TOLERANCE[torch.bfloat16])
    assert_close("sumsq (graph replay)", captured["sumsq"], ref["sumsq"], *REDUCTION_TOLERANCE)
    a.copy_(torch.randn(a.shape, generator=gen).to(a))
    graph.replay()
    torch.cuda.synchronize()
    ref = cc.evaluate(program, a, b, ops).outputs
    assert_close("sumsq (second replay)", captured["sumsq"], ref["sumsq"], *REDUCTION_TOLERANCE)
    cold = Kernel(program)
    with pytest.raises(cc.ArgumentError, match="CUDA graph capture"):
        with torch.cuda.stream(stream):
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                cold(a, b, **ops)


@pytest.mark.parametrize("in_gemm", [False, True], ids=["finishing_kernel", "in_gemm"])
def test_calls_share_their_plans_partials_on_its_stream_only(in_gemm):
    """Calls that do not return the partials share their plan's partials (and arrival counters,
    where the GEMM finishes them; CallPlan.scratch) on the stream that made them: calls queued
    back to back on other inputs each finish their own values, and leave the counters zero.  A
    call on another stream, running beside them, and partials returned to the caller are their
    own tensors."""
    program = library.get("residual_sumsq")
    gen = torch.Generator().manual_seed(29)
    inputs = [make_inputs(program, 300, 528, 200, torch.bfloat16, gen) for _ in range(3)]
    kernel = Kernel(program, finish_in_gemm=in_gemm)
    results = [kernel(a, b, **ops) for a, b, ops in inputs]  # no synchronization in between
    (plan,) = kernel._plans.values()
    scratch, arrivals = plan.scratch()
    assert plan.scratch()[0] is scratch and plan.scratch()[1] is arrivals and (arrivals is not None) == in_gemm
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        assert plan.scratch()[0] is not scratch
        beside = kernel(inputs[1][0], inputs[1][1], **inputs[1][2])
        returned, parts = kernel(inputs[2][0], inputs[2][1], return_partials=True, **inputs[2][2])
    torch.cuda.current_stream().wait_stream(side)
    kept = parts["sumsq"].clone()
    kernel(inputs[0][0], inputs[0][1], **inputs[0][2])
    torch.cuda.synchronize()
    assert kernel.launches == 6 and all(p.data_ptr() != scratch["sumsq"].data_ptr() for p in parts.values())
    assert torch.equal(parts["sumsq"], kept), "partials returned to the caller were written by a later call"
    assert not (in_gemm and arrivals.any()), "a kernel left its arrival counters set"
    for (a, b, ops), got in zip(inputs + inputs[1:], results + [beside, returned]):
        assert_close("sumsq", got["sumsq"], cc.evaluate(program, a, b, ops).outputs["sumsq"], *REDUCTION_TOLERANCE)


@pytest.mark.parametrize("name", ["rms_swiglu_save", "swiglu_bwd_recompute"])
def test_heavy_epilogue_default_at_a_deep_k(name):
    """Beyond K = 4096 the rules give heavy epilogues cooperative 128x256 (runtime._pingpong_max_k),
    where the SwiGLU backward parks a few values in local memory (cache.SPILL_TOLERATED_ACCESSES):
    the kernels the Llama MLP runs at d = 8192, at a shape that is no multiple of the tile."""
    config = run_and_compare(library.get(name), 1500, 1040, 4104)  # 12.8 GFLOP: not host-bound
    assert (config.tile, config.schedule) == ((128, 256), "cooperative")


def test_a_ping_pong_default_of_a_large_call_runs_unrolled():
    """The SwiGLU backward with h at K <= 4096: ping-pong 128x192 with its subtile loop unrolled
    while tracing (KernelConfig.unroll_subtiles), from the IR's loop ptxas spills it; the small
    calls of the test_library_program_pingpong tests, ping-pong asked for, run the IR's loop."""
    config = run_and_compare(library.get("swiglu_bwd_recompute"), 1500, 4104, 2056)
    assert (config.tile, config.schedule, config.unroll_subtiles) == ((128, 192), "pingpong", True)


@pytest.mark.parametrize("name,table_dtype,tile,cluster,schedule,stage", [
    ("rope_qkv", torch.float32, (128, 192), (1, 2), "pingpong", None),
    ("rope_qkv", torch.bfloat16, (128, 128), (1, 2), "pingpong", True),
    ("rope_qkv", torch.float32, (128, 256), (2, 1), "cooperative", None),
    ("rms_rope_qkv", torch.float32, (128, 192), (1, 2), "pingpong", True),
    ("rms_rope_qkv", torch.float32, (128, 256), (1, 2), "cooperative", True),  # the Llama block's at K > 4096
])
def test_tables_staged_in_smem(name, table_dtype, tile, cluster, schedule, stage):
    """Tables of 256 rows (two 128-row blocks) reach smem by TMA, by default or asked for, one
    slice per subtile: tile rows map to table row block tile_m mod 2, columns wrap at P = 64."""
    run_and_compare(_sized(name, 1040), 700, 1040, 136, tile=tile, cluster=cluster, schedule=schedule, table_rows=256,
                    operand_dtypes={"cos": table_dtype, "sin": table_dtype}, stage_tables=stage)


@cc.epilogue
def branchless_math(acc, bias: cc.ColVec):
    """Division, square root and min/max as the epilogue lowers them (div.full, sqrt.approx,
    NaN-propagating FMNMX), in fp32 so that their error is not hidden by a 16-bit rounding."""
    y = cc.sqrt(abs(acc) + 0.25) / (1.0 + abs(bias)) + cc.clamp(acc, -1.0, 1.0)
    return {"D": (cc.maximum(y, bias) - cc.minimum(acc, bias) + cc.relu(acc)).to(cc.f32)}


def test_division_square_root_and_min_max_match_torch_nan_included():
    """As torch computes them (fp32 tolerance), and NaN where torch gives NaN: rows of A made NaN
    make NaN accumulators, which minimum/maximum/relu/clamp must pass on as torch does."""
    gen = torch.Generator().manual_seed(17)
    a, b, ops = make_inputs(branchless_math, 300, 528, 200, torch.bfloat16, gen)
    a[7] = float("nan")
    a[133, :5] = float("nan")
    kernel = Kernel(branchless_math)
    got = kernel(a, b, **ops)
    assert kernel.launches == 1
    want = cc.evaluate(branchless_math, a, b, ops).outputs["D"]
    assert got.dtype == torch.float32
    assert torch.equal(got.isnan(), want.isnan()), "NaN where torch has none, or none where torch has"
    assert got[7].isnan().all() and got[133].isnan().all()
    finite = ~want.isnan()
    assert_close("D", got[finite], want[finite], *TOLERANCE[torch.float32])


@cc.epilogue
def nan_maxes(acc):
    """Every reduction that takes a maximum, across tiles (finished after the kernel) and within
    a 16-column segment."""
    return {"D": acc.to(cc.f32), "rmax": cc.row_max(acc), "rmaxabs": cc.row_maxabs(acc), "cmax": cc.col_max(acc),
            "cmaxabs": cc.col_maxabs(acc), "rlse": cc.row_logsumexp(acc),
            "E": (acc - cc.row_max(acc, segment=16)).to(cc.f32)}


@pytest.mark.parametrize("in_gemm", [False, True], ids=["finishing_kernel", "in_gemm"])
@pytest.mark.parametrize("schedule", ["cooperative", "pingpong"])
def test_maxima_are_nan_where_torch_amax_is(schedule, in_gemm):
    """A NaN in a row of A makes that row's maxima NaN (and every column's, which it crosses),
    a NaN in a row of B that column's (and every row's), as torch.amax and torch.logsumexp give
    them: the maxima within a thread, across lanes, across warps and across tiles all pass NaN on."""
    gen = torch.Generator().manual_seed(23)
    for operand, row in (("a", 133), ("b", 300)):
        a, b, ops = make_inputs(nan_maxes, 300, 528, 200, torch.bfloat16, gen)
        (a if operand == "a" else b)[row, 3] = float("nan")
        kernel = Kernel(nan_maxes, tile=(128, 128), cluster=(1, 1), schedule=schedule, finish_in_gemm=in_gemm)
        got = kernel(a, b, **ops)
        assert kernel.last.path == "kernel" and kernel.launches == 1
        want = cc.evaluate(nan_maxes, a, b, ops).outputs
        for name, value in got.items():
            assert torch.equal(value.isnan(), want[name].isnan()), \
                f"{name}: NaN where torch has none, or none where it has"
            finite = ~want[name].isnan()
            assert_close(name, value[finite], want[name][finite], *REDUCTION_TOLERANCE)
        nan_rows, nan_cols = int(got["rmax"].isnan().sum()), int(got["cmax"].isnan().sum())
        assert (nan_rows, nan_cols) == ((1, 528) if operand == "a" else (300, 1))


@pytest.mark.parametrize("tile,cluster,schedule", [
    ((128, 256), (1, 2), "cooperative"), ((128, 256), (2, 1), "cooperative"), ((256, 128), (2, 1), "cooperative"),
    ((64, 256), (1, 1), "cooperative"), ((128, 128), (1, 2), "pingpong"), ((64, 128), (2, 1), "pingpong"),
])
@pytest.mark.parametrize("name", ["cross_entropy_dh", "cross_entropy_dw"])
def test_lm_head_gradients_from_stored_logits(name, tile, cluster, schedule):
    """The A transform on a real head's logits (tokens, vocab), as linear_cross_entropy's backward
    passes them: dh reads them as stored (K-major) against the weight read as (d, vocab); dW their
    transpose (M-major) against h read as (d, tokens). Ragged tokens, vocab and d; ignored rows;
    against the reference interpreter and against torch's own gradient of the stored logits."""
    from coda_cute.nn import cross_entropy_grad

    tokens, vocab, d = 1000, 1032, 264
    gen = torch.Generator().manual_seed(tile[0] + tile[1] + len(schedule))
    h = torch.randn(tokens, d, generator=gen).bfloat16().cuda()
    w = (torch.randn(vocab, d, generator=gen) * 3 / d ** 0.5).bfloat16().cuda()
    logits = h @ w.t()
    lse = torch.logsumexp(logits.float(), -1)
    target = torch.randint(0, vocab, (tokens,), generator=gen, dtype=torch.int32).cuda()
    target[::7] = -1
    dloss = (target >= 0).float() / (target >= 0).sum()
    program = library.get(name)
    a, b = (logits, w.t()) if name == "cross_entropy_dh" else (logits.t(), h.t())
    operands = dict(lse=lse, target=target, dloss=dloss)
    kernel = Kernel(program, tile=tile, cluster=cluster, schedule=schedule)
    views, buffers = poisoned_outputs(program, a.shape[0], d, torch.bfloat16)
    got = kernel(a, b, out=views, **operands)
    torch.cuda.synchronize()
    assert kernel.last.path == "kernel" and kernel.launches == 1, "the generated kernel did not run"
    check_guard("D", buffers["D"], a.shape[0], d)
    ref = cc.evaluate(program, a, b, operands).outputs["D"]
    scale = ref.float().abs().max().item()
    assert_close("D", got, ref, 2e-2 * scale, 2e-2)
    dlogits = cross_entropy_grad(logits, lse, target.clamp(min=0), dloss).float()
    want = dlogits @ w.float() if name == "cross_entropy_dh" else dlogits.t() @ h.float()
    assert_close("D (torch's gradient)", got, want, 2e-2 * scale, 2e-2)

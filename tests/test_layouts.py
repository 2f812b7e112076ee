"""The register <-> coordinate mappings the epilogue relies on, checked on the CPU.

N-wide 16-bit tiles move between registers and shared memory with stmatrix / ldmatrix in
the accumulator's layout: the emitted body writes the value of accumulator pair
((e, h, j), m_block) into fragment slot `slot0 + e`.  Other widths go through views of the
epilogue ring in accumulator coordinates (`acc_view_of_ring`): accumulator column c of a
tile lands in ring column c // 2 (N/2 wide) or 2c + lane (2N wide) of its subtile's stage.
Here CuTe's layout algebra (static, evaluated while tracing, no GPU) says which (row, col)
each slot or view element holds, and the tests check it, for the schedules, tiles and
subtile widths the generator picks.  A wrong mapping would only show on the GPU as a
permuted output.
"""

import re

import pytest

from coda_cute import library
from coda_cute.compile import import_source
from coda_cute.config import KernelConfig
from coda_cute.render import emit

CONFIGS = [
    ("gemm", KernelConfig(tile=(128, 256), cluster=(1, 2))),
    ("gemm", KernelConfig(tile=(128, 128))),
    ("gemm", KernelConfig(tile=(128, 64))),
    ("gemm", KernelConfig(tile=(64, 256), schedule="pingpong", cluster=(2, 1))),
    ("gemm", KernelConfig(tile=(64, 128), schedule="pingpong")),
    ("gemm", KernelConfig(tile=(128, 128), schedule="pingpong", cluster=(1, 2))),  # two MMA blocks per warpgroup
    ("gemm", KernelConfig(tile=(128, 192), schedule="pingpong", cluster=(1, 2))),  # 192 accumulators per thread
    ("rmsnorm_bwd", KernelConfig(tile=(128, 256), cluster=(1, 2))),  # 16-column subtiles
]
THREADS = (0, 1, 2, 3, 4, 31, 32, 63, 77, 127, 128, 200, 255)


def _check_fragment_slots(source: str) -> int:
    import cutlass
    import cutlass.cute as cute

    kernel = import_source(source)
    slot_expr = re.search(r"^\s*slot0 = (.+)$", source, re.M).group(1)  # the body's own formula
    slot_of = eval(f"lambda h, j, m_block, mma_m, EPI_N: {slot_expr}")  # our template's text, not user input
    threads = [t for t in THREADS if t < kernel.TILE_THREADS]
    checked = []

    @cute.jit
    def probe():
        tiled_mma = kernel.make_tiled_mma()  # the kernel's own constructions, not copies of them
        store = cute.make_tiled_copy_S(  # as the kernel's subtile_fragment
            kernel.sm90_utils.get_smem_store_op(kernel.LayoutEnum.ROW_MAJOR, cutlass.BFloat16, cutlass.Float32),
            kernel.make_acc_copy_layout(tiled_mma),
        )
        epi_n = kernel.EPI_N
        for ctidx in cutlass.range_constexpr(len(threads)):  # unrolled while tracing: all static
            ctidx = threads[ctidx]
            coords = tiled_mma.get_slice(ctidx).partition_C(cute.make_identity_tensor((kernel.TILE_M, kernel.TILE_N)))
            fragment = store.get_slice(ctidx).partition_S(cute.make_identity_tensor((kernel.TILE_M, epi_n)))
            mma_m = cute.size(coords, mode=[1])
            for subtile in cutlass.range_constexpr(kernel.EPI_SUBTILES):
                for m_block in cutlass.range_constexpr(mma_m):
                    for j in cutlass.range_constexpr(subtile * (epi_n // 8), (subtile + 1) * (epi_n // 8)):
                        for h in cutlass.range_constexpr(2):
                            slot0 = slot_of(h, j, m_block, mma_m, epi_n)
                            for e in cutlass.range_constexpr(2):
                                row, col = coords[((e, h, j), m_block, 0)]
                                f_row, f_col = fragment[slot0 + e]
                                assert (f_row, f_col + subtile * epi_n) == (row, col), (
                                    f"thread {ctidx}, pair ((e={e}, h={h}, j={j}), m_block={m_block}): "
                                    f"slot {slot0 + e} holds ({f_row}, {f_col}) of subtile {subtile}, "
                                    f"the accumulator element is ({row}, {col})"
                                )
                                checked.append(1)

    cute.compile(probe, options="--gpu-arch sm_90a")
    return len(checked)


@pytest.mark.parametrize("name,config", CONFIGS,
                         ids=[f"{n}-{c.tile[0]}x{c.tile[1]}-{c.schedule}" for n, c in CONFIGS])
def test_fragment_slot_holds_the_accumulator_pair(name, config):
    source = emit(library.get(name), config)
    assert "slot0 = " in source, "this configuration no longer uses the fragment path"
    assert _check_fragment_slots(source) > 0


VIEW_CONFIGS = [
    ("swiglu", KernelConfig(tile=(128, 256), cluster=(1, 2))),  # N/2-wide output
    ("swiglu_bwd", KernelConfig(tile=(128, 256), cluster=(1, 2))),  # 2N-wide input and output, 16-column subtiles
    ("swiglu_bwd", KernelConfig(tile=(64, 256), schedule="pingpong", cluster=(2, 1))),
    ("swiglu_bwd_recompute", KernelConfig(tile=(128, 128))),
    ("swiglu_bwd", KernelConfig(tile=(128, 128), schedule="pingpong")),
    ("swiglu", KernelConfig(tile=(128, 128), schedule="pingpong")),
    ("swiglu_bwd", KernelConfig(tile=(128, 192), schedule="pingpong", cluster=(1, 2))),
    ("swiglu", KernelConfig(tile=(128, 192), schedule="pingpong")),
]


def _check_ring_views(source: str, width: str, stage_count: str) -> int:
    import cutlass
    import cutlass.cute as cute

    kernel = import_source(source)
    threads = [t for t in THREADS if t < kernel.TILE_THREADS]
    epi_n, stages = kernel.EPI_N, getattr(kernel, stage_count)
    cols = {"N/2": epi_n // 2, "2N": 2 * epi_n}[width]
    lanes = (0, 1) if width == "2N" else (0,)
    checked = []

    @cute.jit
    def probe():
        tiled_mma = kernel.make_tiled_mma()
        ring = cute.make_identity_tensor((kernel.TILE_M, cols, stages))  # (row, ring column, stage)
        for t in cutlass.range_constexpr(len(threads)):
            thr = tiled_mma.get_slice(threads[t])
            coords = thr.partition_C(cute.make_identity_tensor((kernel.TILE_M, kernel.TILE_N)))
            for lane in cutlass.range_constexpr(len(lanes)):
                view = thr.partition_C(kernel.acc_view_of_ring(ring, cols, lanes[lane], stages))
                for k in list(range(cute.size(coords))):  # a Python list: iterated while tracing
                    row, col = coords[k]
                    sub = col // epi_n
                    want_col = (col % epi_n) // 2 if width == "N/2" else 2 * (col % epi_n) + lanes[lane]
                    assert view[k] == (row, want_col, sub % stages), (
                        f"thread {threads[t]}, accumulator ({row}, {col}), lane {lanes[lane]}: view holds "
                        f"{view[k]}, want (row {row}, ring column {want_col}, stage {sub % stages})"
                    )
                    checked.append(1)

    cute.compile(probe, options="--gpu-arch sm_90a")
    return len(checked)


@pytest.mark.parametrize("name,config", VIEW_CONFIGS,
                         ids=[f"{n}-{c.tile[0]}x{c.tile[1]}-{c.schedule}" for n, c in VIEW_CONFIGS])
def test_ring_views_put_each_accumulator_column_in_its_ring_column(name, config):
    source = emit(library.get(name), config)
    width = "N/2" if name == "swiglu" else "2N"
    stage_counts = set(re.findall(r"acc_view_of_ring\([^()]*, (EPI_STAGES|IN_STAGES)\)", source))
    assert stage_counts, "no ring view in the emitted source"
    for stage_count in sorted(stage_counts):  # output rings and input rings may differ in depth
        assert _check_ring_views(source, width, stage_count) > 0

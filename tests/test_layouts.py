"""The register <-> coordinate mappings the epilogue relies on, checked on the CPU.

N-wide 16-bit tiles move between registers and shared memory with stmatrix / ldmatrix in
the accumulator's layout: the emitted body writes the value of accumulator pair
((e, h, j), m_block) into fragment slot `slot0 + e`.  Other widths go through views of the
epilogue ring's stage in accumulator coordinates (`acc_view_of_stage`): accumulator column c
of a tile lands in ring column (c % EPI_N) // 2 (N/2 wide) or 2 (c % EPI_N) + lane (2N wide,
32-bit) of the stage viewed, whichever subtile c is in; 2N-wide 16-bit rings are recast to
64-bit words, and column pair (c, c + 1) lands in word c // 2, which must hold ring columns
2c .. 2c + 3 under the ring's swizzle.
Here CuTe's layout algebra (static, evaluated while tracing, no GPU) says which (row, col)
each slot or view element holds, and the tests check it, for the schedules, tiles and
subtile widths the generator picks.  A wrong mapping would only show on the GPU as a
permuted output.
"""

import itertools
import re

import pytest

from coda_cute import library
from coda_cute.compile import compile_program, import_source
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
    ("gemm", KernelConfig(tile=(256, 128), cluster=(2, 1))),  # two warpgroups, two MMA blocks each
    ("rmsnorm_bwd", KernelConfig(tile=(256, 128), cluster=(2, 1))),
]
THREADS = (0, 1, 2, 3, 4, 31, 32, 63, 77, 127, 128, 200, 255)
SOURCE_DIR = None  # where emitted modules are imported from (the fixture below)


@pytest.fixture(autouse=True, scope="module")
def _source_dir(tmp_path_factory):
    global SOURCE_DIR
    SOURCE_DIR = tmp_path_factory.mktemp("src")


def _check_fragment_slots(source: str) -> int:
    import cutlass
    import cutlass.cute as cute

    kernel = import_source(source, SOURCE_DIR)
    lines = source[re.search(r"^\s*slot0 = ", source, re.M).end():].splitlines()
    slot_expr = lines.pop(0)  # the body's own formula, joined where it spans lines
    while slot_expr.count("(") > slot_expr.count(")"):
        slot_expr += " " + lines.pop(0).strip()
    slot_of = eval(f"lambda h, group, m_block, mma_m, EPI_N: {slot_expr}")  # our template's text, not user input
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
                            slot0 = slot_of(h, j - subtile * (epi_n // 8), m_block, mma_m, epi_n)
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
    ("swiglu", KernelConfig(tile=(256, 128), cluster=(2, 1))),
    ("swiglu_bwd", KernelConfig(tile=(256, 128), cluster=(2, 1))),
]


def _check_ring_views(source: str, width: str, stage_count: str) -> int:
    import cutlass
    import cutlass.cute as cute

    kernel = import_source(source, SOURCE_DIR)
    threads = [t for t in THREADS if t < kernel.TILE_THREADS]
    epi_n, stages = kernel.EPI_N, getattr(kernel, stage_count)
    # 2N-wide 16-bit rings are seen as EPI_N // 2 words: mapped like N/2 (see acc_view_of_stage)
    cols = {"N/2": epi_n // 2, "2N": 2 * epi_n, "2N words": epi_n // 2}[width]
    lanes = (0, 1) if width == "2N" else (0,)
    checked = []

    @cute.jit
    def probe():
        tiled_mma = kernel.make_tiled_mma()
        ring = cute.make_identity_tensor((kernel.TILE_M, cols, stages))  # (row, ring column, stage)
        for t in cutlass.range_constexpr(len(threads)):
            thr = tiled_mma.get_slice(threads[t])
            coords = thr.partition_C(cute.make_identity_tensor((kernel.TILE_M, kernel.TILE_N)))
            for lane, stage in itertools.product(range(len(lanes)), range(stages)):
                view = thr.partition_C(kernel.acc_view_of_stage(ring, stage, cols, lanes[lane]))
                for k in list(range(cute.size(coords))):  # a Python list: iterated while tracing
                    row, col = coords[k]
                    want_col = 2 * (col % epi_n) + lanes[lane] if width == "2N" else (col % epi_n) // 2
                    assert view[k] == (row, want_col, stage), (
                        f"thread {threads[t]}, accumulator ({row}, {col}), lane {lanes[lane]}: the view of stage "
                        f"{stage} holds {view[k]}, want (row {row}, ring column {want_col}, stage {stage})"
                    )
                    checked.append(1)

    cute.compile(probe, options="--gpu-arch sm_90a")
    return len(checked)


@pytest.mark.parametrize("name,config", VIEW_CONFIGS,
                         ids=[f"{n}-{c.tile[0]}x{c.tile[1]}-{c.schedule}" for n, c in VIEW_CONFIGS])
def test_ring_views_put_each_accumulator_column_in_its_ring_column(name, config):
    source = emit(library.get(name), config)
    width = "N/2" if name == "swiglu" else "2N words"
    stage_counts = set(re.findall(r"acc_view_of_stage\((?:[^()]|\([^()]*\))*,\s*subtile % (EPI_STAGES|IN_STAGES),", source))
    assert stage_counts, "no ring view in the emitted source"
    if width == "2N words":
        assert "ring_as_words(" in source, "2N-wide bf16 tiles no longer move as 64-bit words"
    for stage_count in sorted(stage_counts):  # output rings and input rings may differ in depth
        assert _check_ring_views(source, width, stage_count) > 0


@pytest.mark.parametrize("config", [
    KernelConfig(tile=(128, 256), cluster=(1, 2), operand_dtypes=(("preact", "f32"),)),
    KernelConfig(tile=(128, 192), schedule="pingpong", cluster=(1, 2), operand_dtypes=(("preact", "f32"),)),
], ids=["128x256-cooperative", "128x192-pingpong"])
def test_ring_views_of_32_bit_2n_tiles(config):
    """32-bit 2N-wide tiles (here an fp32 preact) keep one view per column of a pair, ring
    columns 2c and 2c + 1; only 16-bit ones move as 64-bit words."""
    source = emit(library.get("swiglu_bwd"), config)
    assert "view_in_preact__0 = " in source and "view_in_preact__1 = " in source
    assert "acc_view_of_stage(smem_in_preact, subtile % IN_STAGES, 2 * EPI_N, 1)" in source  # the pair's second column
    assert _check_ring_views(source, "2N", "IN_STAGES") > 0
    if config.schedule == "cooperative":  # the whole kernel, once (the GPU test runs both)
        compile_program(library.get("swiglu_bwd"), config)


def _swizzled_bytes(swizzle, layout, coords, elem_bytes):
    """Byte addresses (from a 1024-aligned base) of a smem tensor at static coordinates: `layout`
    by CuTe, then the pointer's swizzle Sw<B,M,S> on the byte address (a ^= (a >> S) & mask)."""
    import cutlass.cute as cute

    b, m, shift = swizzle.num_bits, swizzle.num_base, swizzle.num_shift
    mask = ((1 << b) - 1) << (m + shift)
    out = []
    for coord in coords:
        address = elem_bytes * cute.crd2idx(coord, layout)
        out.append(address ^ ((address & mask) >> shift))
    return out


@pytest.mark.parametrize("epi_n,stages", [(16, 2), (16, 4), (32, 2), (32, 4)])
def test_word_views_hold_four_adjacent_ring_columns(epi_n, stages):
    """What `ring_as_words` relies on: under the ring's pointer swizzle, the bytes of word
    (r, w, s) of the recast layout are those of 16-bit ring elements (r, 4w .. 4w + 3, s)."""
    import cutlass
    import cutlass.cute as cute

    source = emit(library.get("swiglu_bwd"), KernelConfig(tile=(128, 128), schedule="pingpong"))
    kernel = import_source(source, SOURCE_DIR)
    cols = 2 * epi_n
    checked = []

    def compare(swizzle, ring, words):  # plain Python (a jit function's loops would be staged)
        coords = [(r, w, s) for r in range(kernel.TILE_M) for w in range(cols // 4) for s in range(stages)]
        word_at = _swizzled_bytes(swizzle, words, coords, 8)
        for i in range(4):
            elem_at = _swizzled_bytes(swizzle, ring, [(r, 4 * w + i, s) for r, w, s in coords], 2)
            for coord, word, elem in zip(coords, word_at, elem_at):
                assert elem == word + 2 * i, f"ring element {coord} column +{i} at byte {elem}, its word at {word}"
                checked.append(1)

    @cute.jit
    def probe():
        ring = kernel.epi_smem_layout(cutlass.BFloat16, cols, stages)
        compare(ring.inner, ring.outer, cute.recast_layout(64, 16, ring.outer))

    cute.compile(probe, options="--gpu-arch sm_90a")
    assert len(checked) == 4 * 128 * (cols // 4) * stages


def _pointer_swizzle(pointer):
    """The swizzle a smem pointer carries, as (B, M, S), or None.  A pointer's swizzle acts on
    byte addresses whatever its element type (TMA's 64-byte swizzle is S<2,4,3> on bf16 rings)."""
    if not pointer.type.is_swizzled:
        return None
    swizzle = pointer.type.swizzle_type
    return swizzle.num_bits, swizzle.num_base, swizzle.num_shift


@pytest.mark.parametrize("config", [KernelConfig(tile=(128, 128), schedule="pingpong"),
                                    KernelConfig(tile=(128, 192), schedule="pingpong"), KernelConfig()],
                         ids=["128x128-pingpong", "128x192-pingpong", "default"])
def test_word_views_address_what_the_ring_views_address(config):
    """Each thread's 64-bit word view (ring_as_words) must reach the bytes where its 16-bit view
    of the same ring holds the word's first column: the ring's own pointer swizzle (it acts on
    byte addresses), and 4x the 16-bit offsets after partition_C (both columns of a pair share
    their word).  Three versions that broke this were wrong on the H200: cute.recast_tensor
    dropped the pointer's swizzle (rows 2-7 of every 8 wrong), one recast to 64-bit units
    (S<2,2,3> for S<2,4,3>) misaligned the words, and one moved into the layout came out of
    partition_C as per-thread strides that ignore it."""
    import cutlass
    import cutlass.cute as cute

    kernel = import_source(emit(library.get("swiglu_bwd"), config), SOURCE_DIR)
    threads = [t for t in THREADS if t < kernel.TILE_THREADS]
    checked = []

    def compare(thread, elems, words):  # plain Python while tracing: static layouts
        assert _pointer_swizzle(elems.iterator) is not None, "the probe's ring should swizzle in its pointer"
        assert _pointer_swizzle(words.iterator) == _pointer_swizzle(elems.iterator), (
            f"thread {thread}: words pointer {words.iterator.type}, ring pointer {elems.iterator.type}")
        assert cute.size(words) == cute.size(elems)
        for k in range(cute.size(elems)):  # accumulator element k; k and k + 1 (k even) are a pair
            word, elem = cute.crd2idx(k, words.layout), cute.crd2idx(k - k % 2, elems.layout)
            assert 4 * word == elem, f"thread {thread}, element {k}: word offset {word}, 16-bit offset {elem}"
            checked.append(1)

    @cute.jit
    def probe():
        layout = kernel.epi_smem_layout(cutlass.BFloat16, 2 * kernel.EPI_N, kernel.EPI_STAGES)
        pointer = cute.make_ptr(cutlass.BFloat16, 0, cute.AddressSpace.smem, assumed_align=1024, swizzle_=layout.inner)
        ring = cute.make_tensor(pointer, layout.outer)  # as storage.<ring>.get_tensor(outer, swizzle=inner)
        words = kernel.ring_as_words(ring, layout)
        tiled_mma = kernel.make_tiled_mma()
        for t in cutlass.range_constexpr(len(threads)):
            thr = tiled_mma.get_slice(threads[t])
            for stage in cutlass.range_constexpr(kernel.EPI_STAGES):
                compare(threads[t], thr.partition_C(kernel.acc_view_of_stage(ring, stage, 2 * kernel.EPI_N, 0)),
                        thr.partition_C(kernel.acc_view_of_stage(words, stage, kernel.EPI_N // 2, 0)))

    cute.compile(probe, options="--gpu-arch sm_90a")
    assert len(checked) == len(threads) * kernel.EPI_STAGES * kernel.TILE_M * kernel.TILE_N // kernel.TILE_THREADS


@pytest.mark.parametrize("kind", ["sum", "max"])
@pytest.mark.parametrize("config", [KernelConfig(tile=(128, 256), cluster=(1, 2)),  # 32-column subtiles
                                    KernelConfig(tile=(128, 128), schedule="pingpong", cluster=(1, 2)),  # 16
                                    KernelConfig(tile=(256, 128), cluster=(2, 1))],  # two MMA blocks, 8 warps
                         ids=["128x256-cooperative", "128x128-pingpong", "256x128-cooperative"])
def test_column_exchange_parks_each_columns_warp_total_in_its_slot(config, kind):
    """A column reduction folds each subtile's values over the 8 threads sharing a column by
    halving exchanges (backends.sm90.warp_column_exchange).  Run its lines for one warp in PyTorch,
    lanes as a vector, with each thread's values at the columns CuTe's MMA partition gives
    them: every column of the subtile must get exactly its warp's total, stored once, in its own slot."""
    import types

    import cutlass
    import cutlass.cute as cute
    import torch

    from coda_cute.backends.sm90 import warp_column_exchange

    kernel = import_source(emit(library.get("rmsnorm_bwd"), config), SOURCE_DIR)
    epi_n, values = kernel.EPI_N, kernel.EPI_N // 4
    column = {}  # (lane, value k) -> accumulator column, subtile 0, k = 2 * j + e as the body fills red_

    @cute.jit
    def probe():
        tiled_mma = kernel.make_tiled_mma()
        for lane in cutlass.range_constexpr(32):
            coords = tiled_mma.get_slice(lane).partition_C(cute.make_identity_tensor((kernel.TILE_M, kernel.TILE_N)))
            for j in cutlass.range_constexpr(epi_n // 8):
                for e in cutlass.range_constexpr(2):
                    column[(lane, 2 * j + e)] = int(coords[((e, 0, j), 0, 0)][1])

    cute.compile(probe, options="--gpu-arch sm_90a")
    assert sorted(set(column.values())) == list(range(epi_n))

    lines = warp_column_exchange(kind, "red", epi_n)
    split = next(i for i, line in enumerate(lines) if line.startswith(("value =", "if ctidx %")))
    lanes = torch.arange(32)
    start = torch.randint(-50, 50, (values, 32), generator=torch.Generator().manual_seed(epi_n)).double()
    red = start.clone()
    fake_cute = types.SimpleNamespace(arch=types.SimpleNamespace(shuffle_sync_bfly=lambda x, offset: x[lanes ^ offset]),
                                      math=types.SimpleNamespace(max=lambda x, y, propagate_nan: torch.maximum(x, y)))
    exec("\n".join(lines[:split]), {"red": red, "ctidx": lanes, "where": torch.where, "cute": fake_cute,
                                    "cutlass": types.SimpleNamespace(range_constexpr=range)})

    class Columns:  # tCcAcc of one lane, subtile 0: ((e, h, j), m_block, 0) -> (row, col)
        def __init__(self, lane):
            self.lane = lane

        def __getitem__(self, index):
            (e, _, j), _, _ = index
            return (0, column[(self.lane, 2 * j + e)])

    class Scratch(dict):  # one store per column: a second one would be a wasted (or racing) write
        def __setitem__(self, slot, value):
            assert slot not in self, f"column slot {slot} stored twice"
            super().__setitem__(slot, value)

    scratch = Scratch()
    for lane in range(32):
        exec("\n".join(lines[split:]), {"ctidx": lane, "subtile": 0, "EPI_N": epi_n, "red": [red[0, lane].item()],
                                        "tCcAcc": Columns(lane), "col_scratch": scratch})
    fold = torch.sum if kind == "sum" else torch.amax
    want = {c: fold(torch.stack([start[k, lane] for (lane, k), col in column.items() if col == c])).item()
            for c in range(epi_n)}
    assert scratch == want

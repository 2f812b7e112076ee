"""Every library program cross-compiles for sm_90a on this (GPU-less) machine, and its SASS
shows the kernel we meant to build: WGMMA, TMA loads (multicast in a cluster), register
reallocation, mbarrier synchronization, TMA stores, and no register spills."""

import re

import pytest

import coda_cute as cc
from coda_cute import library
from coda_cute.cache import spills
from coda_cute.compile import compile_program
from coda_cute.config import DEFAULT_SWIZZLE, KernelConfig, unrolled_subtiles
from coda_cute.errors import UnsupportedError
from coda_cute.lower import lower
from coda_cute.render import emit
from coda_cute.runtime import runtime_defaults

pytestmark = pytest.mark.compile


def statements(source: str) -> list[str]:
    """The emitted module's lines, with a statement wrapped over several lines (inside
    brackets) joined into one, as it would read unwrapped."""
    joined, current = [], None
    for line in source.splitlines():
        if current is None:
            current = line
        else:
            part = line.strip()
            if part.startswith((")", "]", "}")):
                current = current.removesuffix(",")
            current += "" if current.endswith(("(", "[", "{")) or part.startswith((")", "]", "}")) else " "
            current += part
        code = current.split("  #", 1)[0]
        if sum(code.count(c) for c in "([{") == sum(code.count(c) for c in ")]}"):
            joined.append(current)
            current = None
    return joined


def _lowerable(config):
    names = []
    for name, program in library.programs().items():
        try:
            lower(program, config)
            names.append(name)
        except UnsupportedError:
            pass
    return names


CONFIGS = {
    "cluster2x1": KernelConfig(tile=(128, 256), cluster=(2, 1)),
    "single_cta": KernelConfig(tile=(128, 128), cluster=(1, 1)),
    "pingpong128": KernelConfig(tile=(128, 128), cluster=(1, 2), schedule="pingpong"),  # two MMA blocks per warpgroup
    "ab3": KernelConfig(ab_stages=3),  # room for input rings up to a whole tile deep
    "pingpong192": KernelConfig(tile=(128, 192), cluster=(1, 2), schedule="pingpong"),  # the heavy-epilogue default
    "rows256": KernelConfig(tile=(256, 128), cluster=(2, 1)),  # two MMA blocks per cooperative warpgroup
    "runtime_default": None,  # per program: what Kernel picks for a large problem
    "runtime_default_unswizzled": None,  # the same, walked in whole cluster columns (no swizzled_tile)
}
# Every program compiles at its runtime default and at ping-pong with two MMA blocks per
# warpgroup (the register-tightest path, different for each epilogue). The other configurations
# change the mainloop or the tile around an epilogue, so they compile a sample that covers each
# kind of epilogue operand and output they affect (the GPU tests run the whole library at each):
SAMPLES = {
    # B multicast along M instead of A along N: the epilogue is unchanged
    "cluster2x1": {"gemm", "residual_sumsq", "rmsnorm_bwd", "swiglu_bwd_recompute"},
    # 128-column tiles, no multicast: fewer subtiles per tile, segments, tables, N/2 and 2N tiles
    "single_cta": {"gemm", "bias_gelu", "swiglu_save", "swiglu_bwd_recompute", "residual_sumsq", "rmsnorm_bwd",
                   "qk_rmsnorm", "rope_qkv", "cross_entropy_stats"},
    # 3 mainloop stages: room for deep input rings, so the programs with tile inputs
    "ab3": {"alpha_beta", "residual_sumsq", "rmsnorm_bwd", "rmsnorm_bwd_residual", "swiglu_bwd"},
    # ping-pong 128x192 is the runtime default of the heavy epilogues; here the others, the list
    # of those that spill there, and qk_rmsnorm's refusal
    "pingpong192": {"gemm", "bias_gelu", "swiglu", "residual_sumsq", "rms_scale_gamma", "cross_entropy_stats",
                    "qk_rmsnorm", "rmsnorm_bwd", "rmsnorm_bwd_residual", "cross_entropy_stats_save"},
    # 256-row tiles: two 64-row blocks per thread for row vectors and reductions, column sums over
    # both, 2N-wide words, row log-sum-exp (which spills there)
    "rows256": {"gemm", "residual_sumsq", "rmsnorm_bwd", "swiglu_bwd", "cross_entropy_stats"},
    # the unswizzled walk only drops swizzled_tile: a plain GEMM, a tile input with a reduction,
    # and the two ping-pong defaults (2N-wide, table gathers)
    "runtime_default_unswizzled": {"gemm", "residual_sumsq", "swiglu_bwd_recompute", "rope_qkv"},
}
CASES = [(name, config_name) for name in _lowerable(KernelConfig()) for config_name in CONFIGS
         if config_name not in SAMPLES or name in SAMPLES[config_name]]


# Where ptxas spills (the test fails when one stops spilling, to keep the list true).  Most park a
# few values in local memory, stored once and loaded once per tile (SPILL_TOLERATED_ACCESSES
# loads and stores of it at most), and may be a default; RMSNorm's backward at ping-pong 128x192
# spills 160-208 bytes in 78-114 places, and its default avoids that tile (README, "Limits today").
# cross_entropy_stats_save at ping-pong (its default at 128x192): a running log-sum-exp per row
# beside the stored logits' subtile, which are rounded a column pair at a time (round_pair).
# cross_entropy_stats at 256x128: its running max and sum for four rows per thread.
# swiglu_bwd_recompute in cooperative tiles (its default beyond K = 4096 at 128x256): its row dot
# beside three outputs, one of them 2N wide, within the 168 registers of a cooperative kernel;
# at ping-pong 128x128 it spills 288 bytes from the IR's subtile loop (as at 128x192, 264) and
# none unrolled while tracing, as the runtime builds large calls' ping-pong kernels
# (KernelConfig.unroll_subtiles; CONFIGS other than the runtime's defaults keep the IR loop).
SPILLS_AT = {"pingpong192": {"rmsnorm_bwd", "rmsnorm_bwd_residual", "cross_entropy_stats_save"},
             "pingpong128": {"cross_entropy_stats_save", "swiglu_bwd_recompute"}, "rows256": {"cross_entropy_stats"},
             "runtime_default": {"cross_entropy_stats_save"},
             "cluster2x1": {"swiglu_bwd_recompute"}, "single_cta": {"swiglu_bwd_recompute"}}


def test_compile_samples_name_library_programs():
    """A renamed or dropped program must not silently leave a sample (nor the spill list)."""
    programs = set(_lowerable(KernelConfig()))
    for config_name, sample in SAMPLES.items():
        assert config_name in CONFIGS and sample <= programs, (config_name, sample - programs)
    for config_name, spilling in SPILLS_AT.items():
        assert spilling <= SAMPLES.get(config_name, programs), (config_name, spilling)


def _config_named(config_name: str, program) -> KernelConfig:
    """CONFIGS[config_name], with the runtime's default for ``program`` where it is None."""
    config = CONFIGS[config_name]
    if config is None:
        tile, cluster, schedule = runtime_defaults(program)
        config = KernelConfig(tile=tile, cluster=cluster, schedule=schedule,
                              unroll_subtiles=unrolled_subtiles(schedule, "sm_90a"))
        config = config.with_(swizzle=1) if config_name.endswith("unswizzled") else config
    return config


@pytest.mark.parametrize("name,config_name", CASES)
def test_library_program_compiles_to_expected_sass(name, config_name, tmp_path):
    program = library.get(name)
    config = _config_named(config_name, program)
    if config_name == "pingpong192" and name == "qk_rmsnorm":  # 128-column heads do not tile 192 columns
        with pytest.raises(UnsupportedError, match="divide the tile's 192 columns"):
            lower(program, config)
        return
    compiled = compile_program(program, config, keep=("sass",), dump_dir=tmp_path / "dump",
                               source_dir=tmp_path / "src", report=True)
    # the runtime's default decision reads spills from the cubin, its stack frame and its loads and
    # stores of local memory (decoded from the code): ptxas' report and nvdisasm agree
    sass = compiled.artifacts["sass"].read_text()
    assert (compiled.stack_frame_bytes > 0) == (compiled.spill_bytes > 0), f"{name}: {compiled.stack_frame_bytes}"
    assert compiled.local_accesses == len(re.findall(r"\b(?:STL|LDL)\b", sass)), f"{name}: {compiled.local_accesses}"
    if name in SPILLS_AT.get(config_name, ()):
        assert compiled.spill_bytes > 0, f"{name} no longer spills at {config_name}: drop it from the list"
        if spills(compiled):  # in more places than the runtime tolerates: its default avoids them, by
            tile, _, schedule = runtime_defaults(program)  # another tile or schedule, or unrolled while tracing
            if (tile, schedule) == (config.tile, config.schedule):
                twin = compile_program(program, config.with_(unroll_subtiles=not config.unroll_subtiles))
                assert config.schedule == "pingpong" and not spills(twin), f"{name}: the default must avoid this spill"
            return
    else:
        assert compiled.local_accesses == 0, f"{name}: local-memory traffic (spills) in the SASS"
        assert compiled.spill_bytes == 0, f"{name}: ptxas reports spills:\n{compiled.report}"
    expected = ["HGMMA", "UTMALDG", "USETMAXREG", "SYNCS"]
    if program.tile_outputs:
        expected.append("UTMASTG")
    for instruction in expected:
        assert instruction in sass, f"{name}: no {instruction} in the SASS"
    # one copy of the mainloop body: 4 k-blocks of 16 x the 64-row MMA blocks of a warpgroup's
    # tile (LLVM unrolled the k loop of 128-row ping-pong, tripling its WGMMAs and ptxas time)
    mma_blocks = config.tile[0] // 64 if config.schedule == "pingpong" else max(1, config.tile[0] // 128)
    assert sass.count("HGMMA") == 4 * mma_blocks, f"{name}: {sass.count('HGMMA')} HGMMA instructions"
    # and they go out as one batch per k step, the last of the batch tracked (gsb0) so that one batch
    # stays in flight: where warp roles' branches look divergent to ptxas (`if a and b` on warp
    # indices can) it serializes every WGMMA instead (remark C7520), each waited for alone
    batch_ends = re.findall(r"HGMMA\S* [^\n]*\bgsb0 ;", sass)
    assert len(batch_ends) == 1 and "C7520" not in compiled.report, f"{name}: ptxas serialized the WGMMAs"
    multicast = "UTMALDG.2D.MULTICAST" in sass
    assert multicast == (config.cluster != (1, 1)), f"{name}: multicast TMA loads only with a cluster"
    assert compiled.registers is not None and compiled.registers <= 232
    finish = sass_functions(sass).get("finish")
    assert (finish is not None) == bool(program.reductions), f"{name}: a finishing kernel exactly where it reduces"
    if finish is not None:
        assert "ACQBULK" in finish, f"{name}: the finishing kernel does not wait for the GEMM (griddepcontrol.wait)"
        assert _longest_load_run(finish) >= 4, f"{name}: the finishing kernel's loads are not in flight together"


def sass_functions(sass: str) -> dict[str, str]:
    """The SASS of each kernel in a cubin, by its name in the emitted module ('kernel', 'finish')."""
    found = {}
    for section in sass.split("\n//--------------------- .text.")[1:]:
        name = re.match(r"kernel_cutlass_([a-z]+)_coda_cute_kernel_", section)
        assert name, section[:200]
        found[name.group(1)] = section
    return found


def _longest_load_run(sass: str) -> int:
    """The most global loads issued one after another with no branch between them."""
    best = run = 0
    for line in sass.splitlines():
        if "LDG" in line:
            run += 1
            best = max(best, run)
        elif "BRA" in line:
            run = 0
    return best


def test_reductions_are_finished_by_a_second_kernel_launched_as_a_dependent():
    """One finishing branch per reduction, calling one helper per kind of fold; the GEMM's host
    function launches it with programmatic dependent launch, and a program without reductions
    has none of it."""
    source = emit(library.get("cross_entropy_stats"), KernelConfig())
    host = source[source.index("    def __call__("):source.index("    @cute.kernel")]
    finish = source[source.index("    def finish("):]
    assert host.count("self.finish(") == 1 and host.count("use_pdl=True") == 1
    assert "grid=[cute.ceil_div(finish_values, 32), 2, 1]" in host
    assert finish.count("cute.arch.griddepcontrol_wait()") == 1
    assert "if which == 0:" in finish and "elif which == 1:" in finish and "which == 2" not in finish
    assert "self.finish_logsumexp(part_lse, out_lse, " in finish  # lse
    assert "self.finish_sum(part_target_logit, out_target_logit, " in finish  # target_logit
    assert finish.count("    def finish_") == 2
    assert "logsumexp_merge(run_max, run_sum, tile_max, tile_sum)" in finish
    assert "total = total + where(t < tiles, part[(clamped, col)], 0.0)" in finish
    assert "griddepcontrol" not in source[:source.index("    def finish(")].replace("griddepcontrol.wait", "")
    plain = emit(library.get("bias_gelu"), KernelConfig())
    assert "def finish(" not in plain and "FINISH_WARPS" not in plain and "use_pdl" not in plain


def test_reductions_are_finished_by_the_last_tile_of_each_row_or_column_of_tiles():
    """A tile counts itself in (a counter per row of tiles, then one per column of tiles) at the
    next tile's start, after a barrier, with a release; learns after that epilogue's subtiles
    (ping-pong: its first) whether it was the last, and only then acquires and sets the counter
    back to zero;
    the last tile folds that row's (column's) partials at the epilogue's end, one helper per kind
    of fold.  The last tile is settled after the tile loop.  No second kernel (finish_in_gemm); a program without
    reductions has none of it (finish_in_gemm is dropped from its configuration)."""
    source = emit(library.get("cross_entropy_stats"), KernelConfig(finish_in_gemm=True))
    words = " ".join(source.split())  # as one line, whatever the renderer wrapped
    kernel = words[words.index("@cute.kernel"):words.index("@cute.jit def count_in(")]
    assert "def finish(" in source and "use_pdl" not in source and "griddepcontrol" not in source
    assert kernel.count("self.count_in(") == 2 and kernel.count("self.last_of(") == 2  # a tile, the tail
    assert kernel.count("self.finish(") == 2
    start = kernel.index("# reductions: count in the last tile")
    assert start < kernel.index("epilogue_barrier.arrive_and_wait()", start) < kernel.index("self.count_in(", start)
    decide = kernel.index("# reductions: was the tile counted in")  # cooperative: after the subtile loop
    assert start < decide < kernel.index("self.last_of(", decide) < kernel.index("self.finish(", decide)
    assert 'atomic_add( arrivals.iterator + tile_m, cutlass.Int32(1), sem="release", scope="gpu" )' in words
    assert words.count("atomic_add(") == 1  # row reductions only: the rows' counters
    last_of = words[words.index("def last_of("):words.index("def finish(")]
    assert "if rows == (N + TILE_N - 1) // TILE_N - 1: cute.arch.fence_acq_rel_gpu() arrivals[tile_m] = 0" in last_of
    assert "self.finish_logsumexp(part_lse, out_lse, tile_m * TILE_M, TILE_M, ctidx)" in words
    assert "self.finish_sum(part_target_logit, out_target_logit, tile_m * TILE_M, TILE_M, ctidx)" in words
    assert "run_max, run_sum = logsumexp_merge(run_max, run_sum, tile_max, tile_sum)" in words
    assert "total = total + part[(t, i)]" in words
    # a row dot; dgamma, a column sum
    both = " ".join(emit(library.get("rmsnorm_bwd"), KernelConfig(finish_in_gemm=True)).split())
    assert both.count("atomic_add(") == 2 and "col_counter = (M + TILE_M - 1) // TILE_M + tile_n" in both
    assert "if (finishing & 2) != 0: # col_sum((acc * x_hat)) self.finish_sum(part_dgamma, out_dgamma, " in both
    plain = emit(library.get("bias_gelu"), KernelConfig(finish_in_gemm=True))
    assert plain == emit(library.get("bias_gelu"), KernelConfig()) and "def finish" not in plain


# Reductions finished in the GEMM (KernelConfig.finish_in_gemm: the runtime's choice for calls too
# small to keep the GPU busy), at the runtime default: a row reduction beside a tile input, a row
# and a column reduction; and at ping-pong 128x128 (the fold's state per warpgroup): those again
# and log-sum-exps beside stored logits (the GPU tests run the whole library so)
FOLD_CASES = [("residual_sumsq", "runtime_default"), ("rmsnorm_bwd", "runtime_default"),
              ("rmsnorm_bwd", "pingpong128"), ("cross_entropy_stats_save", "pingpong128")]


@pytest.mark.parametrize("name,config_name", FOLD_CASES)
def test_reductions_finished_in_the_gemm_compile_to_one_kernel_that_counts_tiles_in(name, config_name, tmp_path):
    program = library.get(name)
    compiled = compile_program(program, _config_named(config_name, program).with_(finish_in_gemm=True), keep=("sass",),
                               dump_dir=tmp_path / "dump", source_dir=tmp_path / "src", report=True)
    sass = compiled.artifacts["sass"].read_text()
    assert compiled.spill_bytes == 0 and "LDL" not in sass and "STL" not in sass, f"{name}: spills"
    assert list(sass_functions(sass)) == ["kernel"], f"{name}: one kernel (reductions are finished in it)"
    released, acquired = counting_fences(sass)
    axes = len({o.axis for o in program.reductions})
    assert (released, acquired) == (2 * axes, 2 * axes), (
        f"{name}: per reduced axis, a tile counts itself in (released) and acquires where it was the last, "
        f"once in the tile loop and once in the tail: {released}, {acquired}")


def counting_fences(sass: str) -> tuple[int, int]:
    """(global atomic adds behind a GPU-scope fence: the releases that count tiles in, GPU-scope
    fences followed by an L1 invalidation: the acquires of the tiles that found they were last)."""
    released = re.findall(r"MEMBAR\.ALL\.GPU ;\n(?:.*\n){0,3}.*ATOMG\.E\.ADD\.STRONG\.GPU", sass)
    acquired = re.findall(r"MEMBAR\.ALL\.GPU ;\n(?:.*\n){0,3}.*CCTL\.IVALL", sass)
    return len(released), len(acquired)


def names_that_extend_others(acc, x: cc.Tile, x_part: cc.RowVec):
    """Every kind of user name next to one that extends it by '_' and a word the kernel appends
    to its own names (TMA tensor, smem partition, running max): each must stay its own."""
    y = acc + x * x_part
    return {"D": y, "D_tensor": y * 2.0, "lse": cc.row_logsumexp(y), "lse_max": cc.row_sum(y)}


ROLES = ("in_", "out_", "part_", "smem_in_", "smem_out_", "view_in_", "view_out_", "tma_in_", "tma_out_", "red_",
         "r2s_out_", "s2r_in_", "frag_in_", "frag_out_", "frag_table_", "v_")


def test_names_from_user_input_are_prefixed_and_never_collide(tmp_path):
    """Every emitted identifier that starts with a user-name prefix is that prefix, a user name and
    optionally '__' and a word; no prefix starts another; so two user names never meet in one
    emitted name (outputs D and D_tensor once shared tma_out_D_tensor: a SyntaxError; lse's
    running max and output lse_max shared red_lse_max: wrong values)."""
    import ast

    assert not [(a, b) for a in ROLES for b in ROLES if a != b and b.startswith(a)]
    program = cc.epilogue(names_that_extend_others)
    programs = [program] + [library.get(name) for name in _lowerable(KernelConfig())]
    for prog in programs:
        source = emit(prog, KernelConfig())
        users = {op.name for op in prog.operands} | {out.name for out in prog.outputs}
        tree = ast.parse(source)
        names = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
        names |= {arg.arg for node in ast.walk(tree) if isinstance(node, ast.arguments) for arg in node.args}
        for name in names:
            role = next((r for r in ROLES if name.startswith(r)), None)
            if role is None or role == "v_":  # values are named apart by the lowering's own counter
                continue
            user = name[len(role):].split("__")[0]
            assert user in users, f"{prog.name}: {name} is not {role!r} + a user name (+ '__word')"
        compile(source, "kernel.py", "exec")  # duplicate parameters are a SyntaxError
    assert "red_lse__max" in emit(program, KernelConfig()) and "red_lse_max =" in emit(program, KernelConfig())
    compile_program(program, KernelConfig(), source_dir=tmp_path)  # x's and x_part's smem once met in the DSL


def test_persistent_grid_is_bounded_by_the_sm_count(tmp_path):
    """The host function launches min(tiles, MAX_ACTIVE_CLUSTERS * cluster) CTAs (the DSL's
    persistent scheduler), so the emitted constants must keep that within the GPU."""
    from coda_cute.compile import import_source
    from coda_cute.config import CLUSTER_SHAPES, GPU_ARCHS, GPUS

    from coda_cute.backends.sm100 import CLUSTERS, TILES

    for gpu in GPUS:
        arch = GPU_ARCHS[gpu]
        shapes = ([((128, 256), c) for c in CLUSTER_SHAPES] if arch == "sm_90a"
                  else [(tile, cluster) for tile in TILES for cluster in CLUSTERS[tile[0]]])  # all sm_100a builds
        for tile, cluster in shapes:
            config = KernelConfig(arch=arch, gpu=gpu, tile=tile, cluster=cluster)
            module = import_source(emit(library.get("gemm"), config), tmp_path)
            ctas = module.MAX_ACTIVE_CLUSTERS * module.CLUSTER_M * module.CLUSTER_N
            assert ctas <= module.SM_COUNT == GPUS[gpu]
            source = "\n".join(statements(emit(library.get("gemm"), config)))
            assert "get_grid_shape(scheduler_params, MAX_ACTIVE_CLUSTERS)" in source


@pytest.mark.parametrize("config", [KernelConfig(), KernelConfig(tile=(64, 256), cluster=(1, 1)),
                                    KernelConfig(tile=(64, 256), cluster=(1, 2), schedule="pingpong"),
                                    KernelConfig(tile=(128, 192), cluster=(2, 1), schedule="pingpong")],
                         ids=["cooperative-2wg", "cooperative-1wg", "pingpong", "pingpong-128x192"])
def test_register_reallocation_fits_the_launch_pool(config, tmp_path):
    """setmaxnreg.inc waits until the CTA's register pool (the launch count x threads) has the
    registers: consumers asking for more than the producer gave back hang the kernel (a
    producer at 48 instead of 40 registers did, on the H200)."""
    compiled = compile_program(library.get("gemm"), config, source_dir=tmp_path / "src", report=True)
    kernel = compiled.module
    pool = compiled.registers * kernel.NUM_THREADS
    wanted = 128 * kernel.PRODUCER_REGS + 128 * kernel.CONSUMER_WARPGROUPS * kernel.CONSUMER_REGS
    assert wanted <= pool, f"{wanted} registers asked for after reallocation, {pool} in the CTA's pool"
    assert kernel.PRODUCER_REGS % 8 == 0 and kernel.CONSUMER_REGS % 8 == 0 and kernel.CONSUMER_REGS <= 256


def test_explicit_mainloop_stages_are_taken_exactly_or_refused():
    assert lower(library.get("residual_sumsq"), KernelConfig(ab_stages=3)).cfg["ab_stages"] == 3
    with pytest.raises(UnsupportedError, match="8 mainloop stages do not fit"):
        lower(library.get("gemm"), KernelConfig(ab_stages=8))  # 8 x 48 KB of A/B stages


def test_explicit_ring_depths_are_taken_exactly_or_refused():
    """The plan's shared-memory split can be overridden ring by ring; what does not fit, does not
    divide the subtiles, or names rings the program lacks is refused before any compiler runs."""
    cfg = lower(library.get("residual_sumsq"), KernelConfig(ab_stages=3, epi_stages=4)).cfg
    assert (cfg["ab_stages"], cfg["epi_n"], cfg["epi_stages"], cfg["in_stages"]) == (3, 32, 4, 4)
    cfg = lower(library.get("residual_sumsq"), KernelConfig(ab_stages=3, in_stages=4)).cfg
    assert (cfg["ab_stages"], cfg["in_stages"]) == (3, 4)
    cfg = lower(library.get("gemm"), KernelConfig(epi_stages=2)).cfg
    assert (cfg["ab_stages"], cfg["epi_stages"]) == (4, 2)
    assert "--epi-stages 2" in emit(library.get("gemm"), KernelConfig(epi_stages=2))
    with pytest.raises(UnsupportedError, match="output rings 16 subtiles deep do not fit"):
        lower(library.get("residual_sumsq"), KernelConfig(ab_stages=4, epi_stages=16))
    with pytest.raises(UnsupportedError, match="do not divide"):
        lower(library.get("gemm"), KernelConfig(tile=(128, 192), epi_stages=8))  # 6 or 12 subtiles
    with pytest.raises(UnsupportedError, match="no tile inputs"):
        lower(library.get("gemm"), KernelConfig(in_stages=2))
    for bad in (1, 17, "4", -2):
        with pytest.raises(UnsupportedError, match="expected 2..16 subtiles"):
            KernelConfig(epi_stages=bad).check()


def test_cooperative_tile_inputs_get_a_tile_deep_ring_where_it_fits():
    """Planned automatically, a cooperative 128x256 kernel with tile inputs loads a whole tile's
    inputs ahead (3 mainloop stages, the rest for the ring); where that does not fit at 32-column
    subtiles it keeps 32-column subtiles at 3 stages; other tiles and schedules plan as before."""
    def plan(name, config):
        cfg = lower(library.get(name), config).cfg
        return cfg["epi_n"], cfg["in_stages"], cfg["ab_stages"]

    assert plan("residual_sumsq", KernelConfig()) == (32, 8, 3)
    assert plan("alpha_beta", KernelConfig(cluster=(1, 2))) == (32, 8, 3)
    assert plan("rmsnorm_bwd", KernelConfig()) == (32, 4, 3)  # 64 KB of x does not fit beside 3 stages
    assert plan("rmsnorm_bwd", KernelConfig(ab_stages=4)) == (16, 4, 4)  # 4 stages: 16-column subtiles
    assert plan("residual_sumsq", KernelConfig(tile=(128, 128), schedule="pingpong")) == (16, 4, 6)
    assert plan("residual_sumsq", KernelConfig(ab_stages=4)) == (32, 2, 4)  # stages given: as asked
    assert plan("gemm", KernelConfig())[2] == 4


def test_row_sums_skip_the_column_mask_only_where_padding_is_zero():
    """Past N the accumulator and N-wide tile inputs are 0 (TMA zero fill): a row sum of a value
    built from them with zero-keeping ops needs no `col < N` mask; one that a row vector scales
    (which need not be finite) keeps it."""
    @cc.epilogue
    def scaled(acc, rstd: cc.RowVec):
        y = acc * rstd
        return {"D": y, "s": cc.row_sum(y)}

    def sum_lines(program):  # the lines that fold a value into a reduction register: red_x[i] = red_x[i] + ...
        lines = lower(program, KernelConfig()).body
        return [line for line in lines if re.match(r"\s*(red_\w+\[[^=]*\]) = \1 ", line)]

    (line,) = sum_lines(library.get("residual_sumsq"))
    assert "where" not in line and "v_h_0 * v_h_0" in line
    (line,) = sum_lines(scaled)
    assert "where(col < N" in line
    assert all("where(" in line for line in sum_lines(library.get("rmsnorm_bwd")))


def test_values_said_to_be_zero_past_n_are_zero_there_in_the_reference():
    """The lowering drops a row sum's `col < N` mask where _zero_past_n says the summed value is
    exactly 0 in padding columns; the reference interpreter, given what the kernel sees there
    (B's rows and N-wide tile and column operands zero, finite row vectors and scalars), must
    agree for every value it says so of, in the library and in random compositions."""
    import torch
    from random_programs import random_program

    from coda_cute.arguments import bind
    from coda_cute.lower import ONE, _zero_past_n
    from coda_cute.reference import _Evaluator

    gen = torch.Generator().manual_seed(0)
    m, n, k, pad = 6, 24, 8, 5  # the last `pad` columns play the padding past N
    checked = 0
    for program in [library.get(name) for name in library.programs()] + [random_program(s) for s in range(300)]:
        operands = {}
        for op in program.operands:
            if op.kind == "scalar":
                operands[op.name] = 0.7
                continue
            cols = int(n * (op.width or 1))
            shape = {"row": (m,), "col": (cols,), "tile": (m, cols), "table": (4, 16), "kvec": (k,)}[op.kind]
            value = torch.randn(*shape, generator=gen) * 3
            if op.kind in ("col", "tile") and op.width == ONE:
                value[..., n - pad:] = 0
            operands[op.name] = value
        a, b = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
        b[n - pad:] = 0
        try:
            problem = bind(program, a, b, operands)
        except cc.ArgumentError:
            continue  # an operand shape this simple builder does not make (e.g. a table's period)
        values = _Evaluator(problem, problem.a @ problem.b.t()).run()
        for node in program.nodes:
            if node.width == ONE and _zero_past_n(program, node):
                value = values[id(node)].expand(m, n)
                assert torch.all(value[:, n - pad:] == 0), f"{program.name}: {node.describe()} is not 0 past N"
                checked += 1
    assert checked > 300, checked  # not vacuous


def test_input_stages_are_freed_early_only_where_every_input_is_in_registers():
    """A cooperative kernel whose tile inputs are all copied into registers (ldmatrix) at a
    subtile's start frees their stage right then, once; others free it at the subtile's end."""
    early = "the subtile's inputs are in registers now"

    def release_points(name, config):
        source = emit(library.get(name), config)
        return source.count(early), source.count("epi_load_pipeline.consumer_release(")

    assert release_points("residual_sumsq", KernelConfig()) == (1, 1)
    assert release_points("rmsnorm_bwd", KernelConfig()) == (1, 1)
    # 2N-wide preact is read from smem while the subtile computes
    assert release_points("swiglu_bwd", KernelConfig()) == (0, 1)
    pingpong = KernelConfig(tile=(128, 128), schedule="pingpong")
    assert release_points("residual_sumsq", pingpong) == (0, 1)
    assert release_points("gemm", KernelConfig()) == (0, 0)


@pytest.mark.parametrize("bad", [3, 16, 0, "4", 4.0, True])
def test_swizzle_is_one_of_the_schedulers_and_an_int(bad):
    """It is printed into the emitted source: only the band widths swizzled_tile is run with."""
    with pytest.raises(UnsupportedError, match="swizzle .*: expected one of 1, 2, 4, 8"):
        KernelConfig(swizzle=bad).check()


def test_raster_is_a_bool():
    with pytest.raises(UnsupportedError, match="raster_along_m 'False': expected True or False"):
        KernelConfig(raster_along_m="False").check()


def test_the_subtile_loop_is_unrolled_while_tracing_only_where_asked_and_on_sm_90a():
    """The same epilogue either way; only the loop's form differs (KernelConfig.unroll_subtiles)."""
    program, pingpong = library.get("swiglu_bwd"), KernelConfig(tile=(128, 192), cluster=(1, 2), schedule="pingpong")
    ir_loop, traced = "cutlass.range(EPI_SUBTILES, unroll_full=True)", "cutlass.range_constexpr(EPI_SUBTILES)"
    sources = {unrolled: emit(program, pingpong.with_(unroll_subtiles=unrolled)) for unrolled in (False, True)}
    assert sources[False].count(ir_loop) == 1 and sources[True].count(ir_loop) == 0  # the epilogue's loop
    assert sources[True].count(traced) == sources[False].count(traced) + 1  # (the producer's loads unroll anyway)
    assert "subtile loop unrolled while tracing" in pingpong.with_(unroll_subtiles=True).describe()
    with pytest.raises(UnsupportedError, match="unroll_subtiles 1: expected True or False"):
        KernelConfig(unroll_subtiles=1).check()
    with pytest.raises(UnsupportedError, match="sm_100a kernels keep their epilogue's subtile loop rolled"):
        KernelConfig(arch="sm_100a", gpu="B200", unroll_subtiles=True).check()


@pytest.mark.parametrize("raster_along_m", [True, False])
@pytest.mark.parametrize("cluster", [(1, 2), (2, 1), (1, 1)])
@pytest.mark.parametrize("swizzle", [2, 4, 8])
def test_swizzled_tile_walks_every_tile_once_in_bands(raster_along_m, cluster, swizzle, tmp_path):
    """The emitted swizzled_tile, run on Python ints over the scheduler's whole walk: every tile
    exactly once, CTAs of a cluster kept together, and bands of `swizzle` cluster columns (rows)
    walked side by side, the last one narrower when they do not divide the grid."""
    from types import SimpleNamespace

    from coda_cute.compile import import_source

    tile_m, tile_n = 128, 256
    config = KernelConfig(cluster=cluster, raster_along_m=raster_along_m, swizzle=swizzle)
    module = import_source(emit(library.get("gemm"), config), tmp_path)
    # the DSL's min and select_ on Python ints (select_ takes only traced conditions)
    module.cutlass = SimpleNamespace(min=min, select_=lambda cond, a, b: a if cond else b)
    for m, n in [(8192, 28672), (700, 1040), (128, 256), (1, 6144), (3000, 512)]:
        clusters_m = -(-m // (tile_m * cluster[0]))
        clusters_n = -(-n // (tile_n * cluster[1]))
        walk = []
        for linear in range(clusters_m * clusters_n):  # CuTe's unswizzled walk of cluster coordinates
            if raster_along_m:
                cm, cn = linear % clusters_m, linear // clusters_m
            else:
                cm, cn = linear // clusters_n, linear % clusters_n
            ctas = [module.swizzled_tile(cm * cluster[0] + i, cn * cluster[1] + j, m, n)
                    for i in range(cluster[0]) for j in range(cluster[1])]
            (first_m, first_n), *_ = ctas
            assert first_m % cluster[0] == 0 and first_n % cluster[1] == 0
            assert ctas == [(first_m + i, first_n + j) for i in range(cluster[0]) for j in range(cluster[1])]
            walk.append((first_m // cluster[0], first_n // cluster[1]))
        assert sorted(walk) == [(i, j) for i in range(clusters_m) for j in range(clusters_n)], (m, n)
        along, across = (clusters_m, clusters_n) if raster_along_m else (clusters_n, clusters_m)
        position = [(cn, cm) if raster_along_m else (cm, cn) for cm, cn in walk]  # (across, along) per step
        for band_start in range(0, across, swizzle):
            width = min(swizzle, across - band_start)
            steps = position[band_start * along:(band_start + width) * along]
            assert {a for a, _ in steps} == set(range(band_start, band_start + width)), "one band, side by side"
            assert [b for _, b in steps] == [k // width for k in range(width * along)], "down the band together"


@pytest.mark.parametrize("swizzle", [1, DEFAULT_SWIZZLE])
def test_swizzled_tile_is_emitted_only_for_a_swizzle(swizzle):
    source = emit(library.get("gemm"), KernelConfig(swizzle=swizzle).check())
    assert ("def swizzled_tile(" in source) == (swizzle > 1)
    calls = source.count("tile_m, tile_n = swizzled_tile(tile_m, tile_n, M, N)")
    assert calls == (2 if swizzle > 1 else 0), "in both role loops: the producer's and the consumers'"


def test_swizzled_tile_order_compiles(tmp_path):
    """Raster along N with swizzle 4: the scheduler's walk regrouped by swizzled_tile."""
    config = KernelConfig(raster_along_m=False, swizzle=4).check()
    compiled = compile_program(library.get("residual_sumsq"), config, keep=("sass",), dump_dir=tmp_path / "dump",
                               source_dir=tmp_path / "src", report=True)
    assert (compiled.module.RASTER_ALONG_M, compiled.module.SWIZZLE) == (False, 4)
    sass = compiled.artifacts["sass"].read_text()
    assert "HGMMA" in sass and "UTMASTG" in sass and compiled.spill_bytes == 0


@pytest.mark.parametrize("seed", range(6))
def test_random_composition_compiles_without_spills(seed, tmp_path):
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from random_programs import random_program

    program = random_program(seed)
    config = [KernelConfig(), KernelConfig(tile=(64, 256), cluster=(1, 2), schedule="pingpong"),
              KernelConfig(tile=(128, 128), cluster=(1, 2), schedule="pingpong")][seed % 3]
    compiled = compile_program(program, config, keep=("sass",), dump_dir=tmp_path / "dump",
                               source_dir=tmp_path / "src", report=True)
    sass = compiled.artifacts["sass"].read_text()
    assert "HGMMA" in sass and "LDL" not in sass and "STL" not in sass
    assert compiled.spill_bytes == 0 and compiled.stack_frame_bytes == 0
    # an IEEE division or square root branches to a slow path for each element (CALL.REL), which
    # keeps ptxas from interleaving the elements' math; div.full and sqrt.approx do not branch
    assert "CALL.REL" not in sass, f"{program.name}: a slow-path call in the SASS"


def _unused_locals(source: str) -> list[str]:
    """Names each function of ``source`` assigns and never reads ('_'-prefixed names excepted),
    and module-level functions nothing calls."""
    import ast
    import symtable

    tree = ast.parse(source)
    loaded = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)}
    uncalled = [f"module: {node.name}" for node in tree.body
                if isinstance(node, ast.FunctionDef) and node.name not in loaded]

    found, tables = [], [symtable.symtable(source, "kernel.py", "exec")]
    while tables:
        table = tables.pop()
        tables += table.get_children()
        if table.get_type() == "function":
            found += [f"{table.get_name()}: {s.get_name()}" for s in table.get_symbols()
                      if s.is_assigned() and not s.is_referenced() and not s.get_name().startswith("_")]
    return uncalled + found


@pytest.mark.parametrize("config", [KernelConfig(cluster=(1, 2)),
                                    KernelConfig(tile=(128, 192), cluster=(1, 2), schedule="pingpong"),
                                    KernelConfig(tile=(64, 256), schedule="pingpong", ab_stages=3),
                                    KernelConfig(tile=(128, 192), cluster=(1, 2), schedule="pingpong",
                                                 table_periods=(("cos", 64), ("sin", 64)), stage_tables=True)],
                         ids=["cooperative", "pingpong-128x192", "pingpong-64x256-ab3", "staged-tables"])
def test_emitted_source_has_no_dead_assignments(config):
    """Template residue check: every value the emitted kernel computes is used (e.g. the tile's
    coordinates only appear in epilogues that read them)."""
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from random_programs import random_program

    programs = [library.get(name) for name in _lowerable(config)] + [random_program(seed) for seed in range(8)]
    for program in programs:
        try:
            source = emit(program, config)
        except UnsupportedError:
            continue
        assert not _unused_locals(source), f"{program.name}: assigned, never read: {_unused_locals(source)}"


def _coordinates_computed_but_not_read(source: str) -> list[str]:
    """`row` / `col` assignments in the epilogue body (per column pair) that no code line of the
    body reads afterwards (comments do not count)."""
    lines = source.splitlines()
    unread = []
    for i, line in enumerate(lines):
        found = re.match(r"(\s*)(row|col) = (row0|col0) \+ ", line)
        if not found:
            continue
        indent, name = found.group(1), found.group(2)
        body = []
        for later in lines[i + 1:]:
            if later.strip() and not later.startswith(indent):
                break
            body.append(later.split("#", 1)[0])
        if not re.search(rf"\b{name}\b", "\n".join(body)):
            unread.append(f"line {i + 1}: {line.strip()}")
    return unread


def test_coordinates_are_computed_only_where_the_body_reads_them():
    """A column pair's global row and column are computed where the epilogue's code reads them,
    not where a comment mentions them (residual_sumsq's 'per-row sumsq' once made it compute `row`)."""
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from random_programs import random_program

    assert "row = row0 + tCcAcc[pair0]" not in emit(library.get("residual_sumsq"), KernelConfig())
    checked = 0
    for program in [library.get(name) for name in _lowerable(KernelConfig())] + [random_program(s) for s in range(40)]:
        source = emit(program, KernelConfig())
        assert not _coordinates_computed_but_not_read(source), program.name
        checked += len(re.findall(r"^\s*(?:row|col) = (?:row0|col0) \+ ", source, re.M))
    assert checked > 20, checked  # not vacuous


def test_an_operand_the_program_never_reads_is_taken_but_not_loaded(tmp_path):
    """The call signature keeps it (callers pass what the program declares); the kernel moves none of it."""
    @cc.epilogue
    def ignores_bias(acc, bias: cc.ColVec, scale: cc.Scalar):
        return acc * 2.0

    source = emit(ignores_bias, KernelConfig())
    assert "in_bias (N,) bf16 (not read by the program)" in source and "in_scale float (not read" in source
    # named twice each: in the docstring's call signature and as host parameters, nowhere in the kernel
    assert source.count("in_bias") == 2 and source.count("in_scale") == 2
    compiled = compile_program(ignores_bias, KernelConfig(), source_dir=tmp_path)
    assert compiled.function is not None


@pytest.mark.parametrize("name,table_dtype,config", [
    ("rope_qkv", "f32", KernelConfig(tile=(128, 192), cluster=(1, 2), schedule="pingpong")),
    ("rope_qkv", "bf16", KernelConfig(tile=(128, 128), cluster=(1, 2), schedule="pingpong")),
    ("rms_rope_qkv", "f32", KernelConfig(cluster=(1, 2))),
], ids=["rope-f32-pingpong192", "rope-bf16-pingpong128", "rms_rope-f32-cooperative"])
def test_staged_tables_load_by_tma_not_gathers(name, table_dtype, config, tmp_path):
    """stage_tables: cos/sin slices reach smem by TMA (the epilogue input warp), the epilogue
    issues no global loads of its own for them, and nothing spills."""
    program = library.get(name).with_constants(rotary_cols=1024)
    config = config.with_(table_periods=(("cos", 64), ("sin", 64)), stage_tables=True,
                          operand_dtypes=(("cos", table_dtype), ("sin", table_dtype)))
    source = emit(program, config)
    assert "in_cos__block" in source and "frag_table_cos" not in source
    compiled = compile_program(program, config, keep=("sass",), dump_dir=tmp_path / "dump",
                               source_dir=tmp_path / "src", report=True)
    sass = compiled.artifacts["sass"].read_text()
    gathers = sass.count("LDG.E")
    assert gathers == (1 if name == "rms_rope_qkv" else 0), f"{gathers} global loads (rstd's is the one expected)"
    assert "UTMALDG" in sass and compiled.spill_bytes == 0


def test_staging_tables_needs_their_period():
    program = library.get("rope_qkv")
    with pytest.raises(UnsupportedError, match="needs its period"):
        lower(program, KernelConfig(stage_tables=True))
    with pytest.raises(UnsupportedError, match="must divide its period P = 12"):
        lower(program, KernelConfig(stage_tables=True, table_periods=(("cos", 12), ("sin", 12))))
    assert not KernelConfig(stage_tables=True).resolved(library.get("gemm")).stage_tables  # no tables: one spelling


@pytest.mark.parametrize("name", ["cross_entropy_stats", "cross_entropy_bwd"])
def test_int32_class_indices_compile_and_are_compared_as_integers(name, tmp_path):
    """linear_cross_entropy passes its targets as int32: they reach shared memory as integers and
    the comparison with the column index is an integer one (exact at any vocabulary)."""
    program = library.get(name)
    config = KernelConfig(tile=(128, 256), cluster=(1, 2), operand_dtypes=(("target", "i32"),))
    source = emit(program, config)
    assert "cute.struct.MemRange[cutlass.Int32, TILE_M]" in source
    assert re.search(r"= v_col\w* == view_in_target\[pair0\]$", source, re.M), "compared as Int32, no conversion"
    assert "cutlass.Float32(view_in_target" not in source and "v_target" not in source
    compiled = compile_program(program, config, keep=("sass",), dump_dir=tmp_path / "dump",
                               source_dir=tmp_path / "src", report=True)
    assert compiled.spill_bytes == 0
    with pytest.raises(UnsupportedError, match="int32 is for row or column vectors the program compares"):
        emit(program, config.with_(operand_dtypes=(("target", "i32"), ("lse", "i32"))) if name.endswith("bwd")
             else emit(library.get("bias_gelu"), KernelConfig(operand_dtypes=(("bias", "i32"),))))

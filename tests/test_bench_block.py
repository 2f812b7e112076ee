"""benchmarks/bench_block.py on the CPU: its --smoke run (every contender's plumbing, ~5 s), its Liger
compositions against eager PyTorch (with stand-ins of Liger's functions, which need a GPU), and the
classification of profiler kernel names."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from coda_cute.nn import rms_norm_reference

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def bench(load_benchmark):
    return load_benchmark("bench_block")


# (profiler name, kind, short name or None): names as the H200 runs in benchmarks/results show them
KERNELS = [
    ("nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_NTN", "gemm", None),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x"
     "_cublas", "gemm", None),
    ("void splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, __nv_bfloat16, true, false, false>(...)",
     "gemm", None),
    ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8>(...)", "gemm", None),
    ("triton_tem_fused_mm_0", "gemm", None),
    ("kernel_cutlass_kernel_coda_cute_kernel_4fcc6e61217bfa89RmsSwigluSaveKernel_object_at__TiledMMA_ThrLayoutVMNK"
     "_2_1_1_1_0_1_0_0_PermutationMNK_____MMAAtom_ThrID_1_0_ShapeMNK_64_256_16_TV_0", "gemm",
     "coda-cute RmsSwigluSaveKernel"),
    ("kernel_cutlass_finish_coda_cute_kernel_a538f1ea5acf5821ResidualSumsqKernel_object_at__tensorptrf32gmemalign16"
     "o1_1", "finish", "coda-cute ResidualSumsqKernel.finish"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x128_1x4x1_cga1x1x1", "attention", None),
    ("void cudnn::fusion::compute_dot_do_o_specialized<true, 128>(void const*, void const*, void*)", "attention", None),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, "
     "cutlass::bfloat16_t>, true, false>(Flash_fwd_params)", "attention", None),
    ("fmha_cutlassB_bf16_aligned_64x64_k128_sm80(PyTorchMemEffAttention::AttentionBackwardKernel<...>)", "attention",
     None),
    ("triton_poi_fused__scaled_dot_product_cudnn_attention_3", "other", None),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "other", None),
    ("void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add<c10::BFloat16>, "
     "std::array<char*, 3ul> >(int, at::native::CUDAFunctor_add<c10::BFloat16>, std::array<char*, 3ul>)", "other",
     None),
    ("Memcpy DtoD (Device -> Device)", "other", None),
    ("Memset (Device)", "other", None),
    ("_rms_norm_forward_kernel", "other", None),
    ("_triton_rope", "other", None),
    ("liger_cross_entropy_kernel", "other", None),
    ("kernel_cutlass_kernel_liger_kernelopsbackends_cutedslrms_normRMSNormKernel_object_at__tensor_0", "other", None),
]


@pytest.mark.parametrize("name, kind, short", KERNELS, ids=[k[0][:40] for k in KERNELS])
def test_kernel_kind(bench, name, kind, short):
    assert bench.kernel_kind(name) == kind
    assert bench.short_name(name) == (short or name)


def test_summarize(bench):
    kernels = [(name, 1.0 + i) for i, (name, _, _) in enumerate(KERNELS)]
    s = bench.summarize(kernels)
    assert s["gpu_ms"] == pytest.approx(sum(ms for _, ms in kernels))
    for kind in ("gemm", "attention", "finish", "other"):
        assert s[f"{kind}_ms"] == pytest.approx(sum(ms for (_, k, _), (_, ms) in zip(KERNELS, kernels) if k == kind))
    assert [name for name, _ in s["other_kernels"]] == [n for n, k, _ in KERNELS if k == "other"]
    assert s["finish_kernels"] == [["coda-cute ResidualSumsqKernel.finish", 7.0]]


def test_bar(bench):
    """floor + (best torch.compile - floor) / 3 per measure; a contender without a measure (an old
    file, a smoke run) gets None for it, not an error."""
    def contender(ms, b2b, gpu, peak):
        return {"ms": ms, "spread": 0.0, "b2b_ms": b2b, "gpu_ms": gpu, "peak_gib": peak}

    row = {"floor": contender(10.0, 9.0, 8.0, 0.5), "torch.compile": contender(13.0, 12.0, 11.0, 1.0),
           "torch.compile max-autotune-no-cudagraphs": contender(12.4, 12.3, 11.6, 1.2),
           "coda-cute": contender(10.7, 10.1, 9.2, 0.9), "coda-cute lean": {"ms": 10.9, "spread": 0.0, "gpu_ms": 8.9,
                                                                          "peak_gib": 0.4}}
    b = bench.bar(row)
    assert b["best_compile"] == {"ms": "torch.compile max-autotune-no-cudagraphs", "gpu_ms": "torch.compile",
                                 "b2b_ms": "torch.compile", "peak_gib": "torch.compile"}
    assert (b["wall_bar_ms"], b["b2b_bar_ms"], b["gpu_bar_ms"]) == pytest.approx((10.8, 10.0, 9.0))
    assert b["coda-cute"] == {"under_wall": True, "under_gpu": False, "under_b2b": False, "peak_ratio": 0.9}
    assert b["coda-cute lean"]["under_b2b"] is None and b["coda-cute lean"]["under_gpu"] is True
    assert bench.bar({"coda-cute": row["coda-cute"], "floor": row["floor"]}) is None


def test_smoke_run(bench, tmp_path):
    """The command line, every case and contender on the CPU, the JSON it writes."""
    out = tmp_path / "smoke.json"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    result = subprocess.run([sys.executable, "-W", "ignore", "benchmarks/bench_block.py", "--smoke", "--out", str(out)],
                            capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    data = json.loads(out.read_text())
    assert set(data["meta"]) == {"date", "gpu", "torch", "commit", "command"}
    rows = {row["case"]: row for row in data["rows"]}
    assert list(rows) == ["MLP", "block", "LM"]
    compiled = ["torch.compile", "torch.compile max-autotune-no-cudagraphs"]
    for case, row in rows.items():
        ours = {"LM": ["coda-cute", "coda-cute lean"], "MLP": ["coda-cute", "coda-cute derived"]}.get(case, ["coda-cute"])
        assert [k for k, v in row.items() if isinstance(v, dict) and "ms" in v] == [
            *ours, "torch eager", *compiled, "floor"]
        for name in ours:
            assert max(row[name]["rel_err"]) < bench.TOLERANCE
            assert set(row["bar"][name]) == {"under_wall", "under_gpu", "under_b2b", "peak_ratio"}
        assert row["dropped"] == {}
        for name in [*ours, "torch eager", *compiled, "floor"]:
            assert {"ms", "spread", "b2b_ms", "gpu_ms", "peak_gib", "other_kernels", "finish_kernels"} <= set(row[name])
    assert rows["LM"]["lean_kwargs"] == "save_logits=False" and rows["LM"]["gradient_gib"] > 0
    assert "under the bar in wall time" in result.stdout


def test_result_files_name_a_changed_tree_as_changed(bench, tmp_path, monkeypatch):
    """A run from a working tree that differs from its HEAD is not recorded as that commit."""
    monkeypatch.delenv("CODA_COMMIT", raising=False)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(tmp_path)]
    subprocess.run([*git, "init", "-q"], check=True)
    (tmp_path / "f.py").write_text("x = 1\n")
    subprocess.run([*git, "add", "f.py"], check=True)
    subprocess.run([*git, "commit", "-qm", "f"], check=True)
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    (tmp_path / "new.py").write_text("")  # untracked: the commit still says what ran
    assert bench.commit(str(tmp_path)) == head
    (tmp_path / "f.py").write_text("x = 2\n")
    assert bench.commit(str(tmp_path)) == head + "+changes"
    monkeypatch.setenv("CODA_COMMIT", "abc1234")
    assert bench.commit(str(tmp_path)) == "abc1234"


class _RMSNorm(nn.Module):  # LigerRMSNorm's interface
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(hidden_size)), eps

    def forward(self, x):
        return rms_norm_reference(x, self.weight, self.eps)


def _rope(q, k, cos, sin):  # liger_rotary_pos_emb: HF rotate-half RoPE, cos / sin (1, seq, head_dim)
    def rotate(t):
        half = t.shape[-1] // 2
        return t * cos[:, None] + torch.cat([-t[..., half:], t[..., :half]], -1) * sin[:, None]
    return rotate(q), rotate(k)


class _FLCE:  # LigerFusedLinearCrossEntropyLoss: (weight, (tokens, d) input, (tokens,) target)
    def __call__(self, weight, x, target):
        return torch.nn.functional.cross_entropy((x @ weight.t()).float(), target)


def test_liger_compositions_match_eager(bench, tmp_path, monkeypatch):
    """With stand-ins that follow Liger's documented interfaces, the Liger contenders compute what eager
    PyTorch does (so on the GPU a mismatch means Liger's kernels, not how this script calls them)."""
    fake = dict(rms_norm=_RMSNorm, silu_mul=lambda a, b: torch.nn.functional.silu(a) * b, rope=_rope, flce=_FLCE)
    monkeypatch.setattr(bench, "_import_liger", lambda smoke: fake)
    out = tmp_path / "liger.json"
    bench.main(["--smoke", "--compile-modes", "--reps", "1", "--out", str(out)])
    for row in json.loads(out.read_text())["rows"]:
        assert row["dropped"] == {} and row["bar"] is None
        assert max(row["Liger"]["rel_err"]) < bench.TOLERANCE, row["case"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the path without a GPU")
def test_step_idle_says_it_needs_a_gpu(load_benchmark, capsys):
    """benchmarks/step_idle.py builds bench_block's cases; without a GPU it stops with a clear message."""
    step_idle = load_benchmark("step_idle")
    assert set(step_idle.CASES) == {"block", "MLP"}
    with pytest.raises(SystemExit):
        step_idle.main(["--d", "2048", "--cases", "MLP"])
    assert "needs a GPU" in capsys.readouterr().err


def test_step_idle_counts_overlapping_kernels_once(load_benchmark):
    """The GPU's busy time in a profiled window is the union of the kernels' intervals: a dependent
    launch waiting under the kernel before it, or two kernels on two streams, are not counted twice,
    so the window's span less it is the time no kernel ran."""
    covered = load_benchmark("step_idle").covered_us
    assert covered([(0, 10), (5, 15), (20, 30)]) == 25  # [0, 15) and [20, 30)
    assert covered([(20, 30), (0, 10), (2, 4)]) == 20  # nested, any order
    assert covered([(0, 10), (10, 12)]) == 12  # touching
    assert covered([]) == 0

"""A transforms: a map applied to the GEMM's A operand as the mainloop loads it (the LM head's
backward from stored logits: `cross_entropy_dh`, `cross_entropy_dw`).  The reference against
torch's own math, the program's checks, binding, lowering and compilation; the kernels run
against the reference in tests/test_gpu_kernels.py."""

import pytest
import torch

import coda_cute as cc
from coda_cute import library
from coda_cute.config import KernelConfig
from coda_cute.errors import ArgumentError, ProgramError, UnsupportedError
from coda_cute.lower import lower
from coda_cute.nn import cross_entropy_grad

DH, DW = library.get("cross_entropy_dh"), library.get("cross_entropy_dw")


def head(tokens=56, vocab=72, d=24, seed=0):
    """h, W, the stored logits, their log-sum-exp, targets (every 7th ignored: -1) and dloss."""
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, d, generator=gen).bfloat16()
    w = (torch.randn(vocab, d, generator=gen) / 2).bfloat16()
    logits = h @ w.t()
    lse = torch.logsumexp(logits.float(), -1)
    target = torch.randint(0, vocab, (tokens,), generator=gen, dtype=torch.int32)
    target[::7] = -1
    dloss = (target >= 0).float() * 0.3
    return h, w, logits, lse, target, dloss


def test_reference_is_the_gradient_torch_computes():
    """acc of cross_entropy_dh / _dw is dlogits @ W / dlogits.T @ h, with dlogits as torch's own
    cross-entropy gradient of the stored logits (rounded to bf16, as the kernel rounds in smem)."""
    h, w, logits, lse, target, dloss = head()
    dlogits = cross_entropy_grad(logits, lse, target.clamp(min=0), dloss).float()
    ops = dict(lse=lse, target=target, dloss=dloss)
    dh = cc.evaluate(DH, logits, w.t(), ops).outputs["D"].float()
    dw = cc.evaluate(DW, logits.t(), h.t(), ops).outputs["D"].float()
    for got, want in ((dh, dlogits @ w.float()), (dw, dlogits.t() @ h.float())):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2 * want.abs().max().item())
    # against autograd of torch's cross-entropy on the same logits, through the GEMMs
    hf, wf = h.float().requires_grad_(), w.float().requires_grad_()
    valid = target >= 0
    loss = (torch.nn.functional.cross_entropy((hf @ wf.t()).bfloat16().float(), target.clamp(min=0).long(),
                                              reduction="none") * dloss).sum()
    loss.backward()
    assert valid.sum() < len(valid)
    torch.testing.assert_close(dh, hf.grad, rtol=2e-2, atol=2e-2 * hf.grad.abs().max().item())
    torch.testing.assert_close(dw, wf.grad, rtol=2e-2, atol=2e-2 * wf.grad.abs().max().item())


def test_listing_fingerprint_and_retrace():
    assert "A transform: acc = softmax_grad(A) @ B.T, a token per A's row" in DH.describe()
    assert "a token per A's index of K" in DW.describe()
    assert DH.tokens_along == "row" and DW.tokens_along == "k"
    plain = cc.epilogue(DH.fn, name="cross_entropy_dh")  # the same function without the transform
    assert plain.a_transform is None and plain.fingerprint != DH.fingerprint
    assert '"a_transform"' not in plain.canonical()  # programs without one keep their fingerprints
    assert DH.with_constants().fingerprint == DH.fingerprint


@pytest.mark.parametrize("params,message", [
    ("lse: cc.RowVec, target: cc.KVec, dloss: cc.RowVec", "all RowVecs .* or all KVecs"),
    ("lse: cc.RowVec, target: cc.RowVec", "missing: dloss"),
    ("lse: cc.RowVec, target: cc.RowVec, dloss: cc.RowVec, x: cc.KVec", r"KVec operand\(s\) \['x'\] are not read"),
    ("lse: cc.ColVec, target: cc.ColVec, dloss: cc.ColVec", "all RowVecs"),
])
def test_transform_operands_are_checked(params, message):
    source = f"def prog(acc, {params}):\n    return acc\n"
    scope = {"cc": cc}
    exec(source, scope)
    with pytest.raises(ProgramError, match=message):
        cc.epilogue(scope["prog"], a_transform="softmax_grad")


def test_kvec_is_for_transforms_only_and_transforms_are_known():
    def reads_kvec(acc, lse: cc.KVec, target: cc.KVec, dloss: cc.KVec):
        return acc * lse

    def plain_kvec(acc, x: cc.KVec):
        return acc

    with pytest.raises(ProgramError, match="only an A transform reads it"):
        cc.epilogue(reads_kvec, a_transform="softmax_grad")
    with pytest.raises(ProgramError, match="the program has none"):
        cc.epilogue(plain_kvec)
    with pytest.raises(ProgramError, match="A transform 'relu' is unknown; known: softmax_grad"):
        cc.epilogue(plain_kvec, a_transform="relu")
    with pytest.raises(ProgramError, match="derivation covers epilogues of a plain product only"):
        cc.derive(DH)


def test_binding_checks_lengths_and_indices():
    h, w, logits, lse, target, dloss = head()
    with pytest.raises(ArgumentError, match=r"'dloss' is a RowVec: expected shape \(56,\)"):
        cc.evaluate(DH, logits, w.t(), dict(lse=lse, target=target, dloss=dloss[:5]))
    with pytest.raises(ArgumentError, match=r"'lse' is a KVec: expected shape \(56,\) \(one value per index of K\)"):
        cc.evaluate(DW, logits.t(), h.t(), dict(lse=lse[:4], target=target, dloss=dloss))
    with pytest.raises(ArgumentError, match="needs operand 'target'"):
        cc.evaluate(DW, logits.t(), h.t(), dict(lse=lse, dloss=dloss))
    # the target is a class index: A's index of K (dh) or its row (dw), exact in its dtype
    big = torch.zeros(8, 300, dtype=torch.bfloat16)
    with pytest.raises(ArgumentError, match="'target' .* compared with k indices up to 299"):
        cc.evaluate(DH, torch.zeros(8, 300, dtype=torch.bfloat16), big,
                    dict(lse=torch.zeros(8), target=torch.zeros(8, dtype=torch.bfloat16), dloss=torch.zeros(8)))


def test_lowering_needs_the_classes_contiguous_and_sm90a():
    with pytest.raises(UnsupportedError, match="A must be K-major .* the logits \\(tokens, classes\\) as stored"):
        lower(DH, KernelConfig(majors="mn"))
    with pytest.raises(UnsupportedError, match="A must be M-major .* logits.t\\(\\)"):
        lower(DW, KernelConfig(majors="kk"))
    with pytest.raises(UnsupportedError, match="sm_100a kernels do not yet"):
        lower(DH, KernelConfig(arch="sm_100a", gpu="B200", tile=(128, 256), cluster=(1, 1)))
    ctx = lower(DW, KernelConfig(majors="mn"))
    assert ctx.a_transform["tokens"] == "k"
    assert [p["name"] for p in ctx.host_params][-3:] == ["in_lse", "in_target", "in_dloss"]
    assert not ctx.vectors  # the transform reads its operands from global memory, not staged


@pytest.mark.parametrize("program,majors,schedule,tile", [
    (DH, "kn", "cooperative", (128, 256)), (DW, "mn", "cooperative", (128, 256)),
    (DH, "kk", "pingpong", (128, 128)), (DW, "mk", "cooperative", (256, 128)),
])
def test_kernels_compile_without_spills(program, majors, schedule, tile, tmp_path):
    pytest.importorskip("cutlass")
    from coda_cute.compile import compile_program

    config = KernelConfig(majors=majors, schedule=schedule, tile=tile, cluster=(2, 1))
    compiled = compile_program(program, config, keep=("sass",), dump_dir=tmp_path / "dump",
                               source_dir=tmp_path / "src")
    assert compiled.stack_frame_bytes == 0
    sass = compiled.artifacts["sass"].read_text()
    # the transform: exp2 on the MUFU, 16-byte shared loads and stores of A, the async-proxy fence
    for instruction in ("HGMMA", "MUFU.EX2", "LDS.128", "STS.128", "FENCE.VIEW.ASYNC.S"):
        assert instruction in sass, instruction

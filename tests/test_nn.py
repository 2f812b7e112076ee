"""LlamaMLP (the CODA rewrite: two fused GEMMs forward, fused dgrads backward) against
PyTorch autograd of the unfused block, on the CPU (every program runs in the reference
interpreter there; tests/test_gpu_nn.py checks the kernels)."""

import pytest
import torch

import coda_cute as cc
from coda_cute import library
from coda_cute.nn import (
    LlamaAttention, LlamaBlock, LlamaMLP, cross_entropy_grad, interleave_gate_up, interleaved_to_rotate_half, linear_cross_entropy,
    llama_attention_reference, llama_mlp_reference, rotate_half_to_interleaved, split_gate_up,
)

# fp32 on both sides; the fused path rounds nothing extra at fp32, so differences are
# accumulation order only
RTOL, ATOL = 2e-4, 2e-5


def _pair(d, ffn, gen, eps=1e-6):
    module = LlamaMLP(d, ffn, eps=eps, dtype=torch.float32)
    with torch.no_grad():
        module.gamma.copy_(torch.rand(d, generator=gen) + 0.5)
        module.w_gate_up.copy_(torch.randn(2 * ffn, d, generator=gen) * d ** -0.5)
        module.w_down.copy_(torch.randn(d, ffn, generator=gen) * ffn ** -0.5)
    return module


@pytest.mark.parametrize("shape", [(37, 24, 40), (2, 9, 16, 32)], ids=["ragged", "batched"])
def test_forward_and_every_gradient_match_autograd(shape, gen):
    *batch, d, ffn = shape
    module = _pair(d, ffn, gen)
    h = torch.randn(*batch, d, generator=gen, requires_grad=True)
    out, sumsq = module(h)
    grad = torch.randn(out.shape, generator=gen)
    (out * grad).sum().backward()

    gate, up = split_gate_up(module.w_gate_up.detach())
    params = [module.gamma.detach().clone().requires_grad_(), gate.clone().requires_grad_(),
              up.clone().requires_grad_(), module.w_down.detach().clone().requires_grad_()]
    h_ref = h.detach().clone().requires_grad_()
    ref = llama_mlp_reference(h_ref, *params, module.eps)
    (ref * grad).sum().backward()

    torch.testing.assert_close(out, ref, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(sumsq, ref.detach().square().sum(-1), rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(h.grad, h_ref.grad, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(module.gamma.grad, params[0].grad, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(module.w_gate_up.grad, interleave_gate_up(params[1].grad, params[2].grad),
                               rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(module.w_down.grad, params[3].grad, rtol=RTOL, atol=ATOL)


def test_chained_blocks_reuse_the_residual_statistics(gen):
    """Block 2 takes block 1's sumsq instead of reducing h again; gradients still match."""
    d, ffn = 24, 40
    first, second = _pair(d, ffn, gen), _pair(d, ffn, gen)
    h = torch.randn(13, d, generator=gen, requires_grad=True)
    mid, stats = first(h)
    out, _ = second(mid, stats)
    out.sum().backward()

    h_ref = h.detach().clone().requires_grad_()
    ref = h_ref
    for block in (first, second):
        gate, up = split_gate_up(block.w_gate_up.detach())
        ref = llama_mlp_reference(ref, block.gamma.detach(), gate, up, block.w_down.detach(), block.eps)
    ref.sum().backward()
    torch.testing.assert_close(out, ref, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(h.grad, h_ref.grad, rtol=RTOL, atol=ATOL)


def test_hugging_face_weights_round_trip(gen):
    d, ffn = 16, 24
    norm, gate, up, down = (torch.randn(d, generator=gen), torch.randn(ffn, d, generator=gen),
                            torch.randn(ffn, d, generator=gen), torch.randn(d, ffn, generator=gen))
    module = LlamaMLP(d, ffn, dtype=torch.float32).load_hf(norm, gate, up, down)
    assert torch.equal(module.w_gate_up[0::2], gate) and torch.equal(module.w_gate_up[1::2], up)
    back = module.hf_weights()
    for key, want in (("post_attention_layernorm.weight", norm), ("mlp.gate_proj.weight", gate),
                      ("mlp.up_proj.weight", up), ("mlp.down_proj.weight", down)):
        assert torch.equal(back[key], want), key
    with pytest.raises(ValueError, match="one shape"):
        interleave_gate_up(gate, up[:-1])


def test_compiles_with_fullgraph(gen):
    module = _pair(16, 24, gen)
    h = torch.randn(10, 16, generator=gen)
    eager = module(h)[0]
    compiled = torch.compile(lambda x: module(x)[0], fullgraph=True)
    torch.testing.assert_close(compiled(h), eager, rtol=RTOL, atol=ATOL)


def _attention(d, heads, kv_heads, gen):
    module = LlamaAttention(d, heads, kv_heads, dtype=torch.float32, max_positions=64)
    with torch.no_grad():
        module.gamma.copy_(torch.rand(d, generator=gen) + 0.5)
        module.w_qkv.copy_(torch.randn(module.w_qkv.shape, generator=gen) * d ** -0.5)
        module.w_o.copy_(torch.randn(module.w_o.shape, generator=gen) * d ** -0.5)
    return module


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2)], ids=["mha", "gqa"])
def test_attention_matches_hugging_face_style_reference(heads, kv_heads, gen):
    """Fused (interleaved RoPE on permuted q/k rows) vs rotate-half RoPE on the HF weights."""
    d = 32
    module = _attention(d, heads, kv_heads, gen)
    hf = module.hf_weights()
    h = torch.randn(3, 10, d, generator=gen, requires_grad=True)
    out, sumsq = module(h)
    grad = torch.randn(out.shape, generator=gen)
    (out * grad).sum().backward()

    names = ["input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
             "self_attn.v_proj.weight", "self_attn.o_proj.weight"]
    params = [hf[n].clone().requires_grad_() for n in names]
    h_ref = h.detach().clone().requires_grad_()
    ref = llama_attention_reference(h_ref, *params, heads, kv_heads, module.head_dim, module.cos, module.sin, module.eps)
    (ref * grad).sum().backward()

    torch.testing.assert_close(out, ref, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(sumsq, ref.detach().square().sum(-1), rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(h.grad, h_ref.grad, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(module.gamma.grad, params[0].grad, rtol=RTOL, atol=ATOL)
    hd = module.head_dim
    q_grad, k_grad, v_grad = module.w_qkv.grad.split([heads * hd, kv_heads * hd, kv_heads * hd])
    torch.testing.assert_close(interleaved_to_rotate_half(q_grad, hd), params[1].grad, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(interleaved_to_rotate_half(k_grad, hd), params[2].grad, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(v_grad, params[3].grad, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(module.w_o.grad, params[4].grad, rtol=RTOL, atol=ATOL)


def test_rope_row_order_conversion_round_trips(gen):
    w = torch.randn(3 * 8, 5, generator=gen)
    inter = rotate_half_to_interleaved(w, 8)
    assert torch.equal(inter[0], w[0]) and torch.equal(inter[1], w[4]) and torch.equal(inter[2], w[1])
    assert torch.equal(interleaved_to_rotate_half(inter, 8), w)
    with pytest.raises(ValueError, match="whole heads"):
        rotate_half_to_interleaved(w[:-1], 8)


def test_block_round_trips_hugging_face_weights_and_runs(gen):
    block = LlamaBlock(32, 4, 48, n_kv_heads=2, dtype=torch.float32, max_positions=16)
    weights = {k: torch.randn(v.shape, generator=gen) for k, v in block.hf_weights().items()}
    block.load_hf(weights)
    back = block.hf_weights()
    assert all(torch.equal(back[k], weights[k]) for k in weights)
    h = torch.randn(2, 8, 32, generator=gen, requires_grad=True)
    out, sumsq = block(h)
    out.sum().backward()
    assert out.shape == h.shape and sumsq.shape == (2, 8) and torch.isfinite(h.grad).all()


# --------------------------------------------------------------------------- LM head + cross-entropy
@pytest.mark.parametrize("save_logits", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_linear_cross_entropy_matches_autograd(reduction, save_logits, gen):
    h = torch.randn(2, 7, 16, generator=gen, dtype=torch.float64).requires_grad_()
    w = (torch.randn(40, 16, generator=gen, dtype=torch.float64) * 0.5).requires_grad_()
    target = torch.randint(0, 40, (2, 7), generator=gen)
    target[0, 3] = target[1, 0] = -100  # ignored: no loss, no gradient
    loss = linear_cross_entropy(h.float(), w.float(), target, reduction=reduction, save_logits=save_logits)
    h_ref, w_ref = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = torch.nn.functional.cross_entropy((h_ref @ w_ref.t()).reshape(-1, 40), target.reshape(-1),
                                            reduction=reduction)
    ref = ref.reshape(2, 7) if reduction == "none" else ref
    grad = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    loss.backward(grad.float())
    ref.backward(grad)
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h.grad, h_ref.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(w.grad, w_ref.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(h.grad[0, 3], torch.zeros(16, dtype=torch.float64))  # ignored row


@pytest.mark.parametrize("save_logits", [False, True])
@pytest.mark.parametrize("wants", ["h", "weight"])
def test_linear_cross_entropy_makes_only_the_gradients_asked_for(wants, save_logits, gen):
    """A frozen weight (or an input without a gradient): the other gradient matches autograd's,
    and none is made for what does not want one."""
    h = torch.randn(9, 16, generator=gen, dtype=torch.float64)
    w = torch.randn(40, 16, generator=gen, dtype=torch.float64) * 0.5
    target = torch.randint(0, 40, (9,), generator=gen)
    h32, w32 = h.float().requires_grad_(wants == "h"), w.float().requires_grad_(wants == "weight")
    linear_cross_entropy(h32, w32, target, save_logits=save_logits).backward()
    h_ref, w_ref = h.clone().requires_grad_(), w.clone().requires_grad_()
    torch.nn.functional.cross_entropy(h_ref @ w_ref.t(), target).backward()
    got, other, want = (h32, w32, h_ref) if wants == "h" else (w32, h32, w_ref)
    torch.testing.assert_close(got.grad.double(), want.grad, rtol=1e-4, atol=1e-5)
    assert other.grad is None


@pytest.mark.parametrize("save_logits,reduction,want", [
    (True, "mean", ["cross_entropy_exp_save"]),  # their exponentials stored, scaled into their gradient in backward
    (False, "mean", ["cross_entropy_stats_save"] * 3),  # gradients in the forward: chunks of 8, 8 and 4 tokens
    (False, "sum", ["cross_entropy_stats_save"] * 3),
    (False, "none", ["cross_entropy_stats"] + ["cross_entropy_bwd"] * 3),  # the logits again in backward
])
def test_linear_cross_entropy_takes_the_path_asked_for(save_logits, reduction, want, gen, monkeypatch):
    """Saved: one logits GEMM, nothing recomputed in backward.  Lean: the logits GEMM per
    token chunk in the forward, or statistics there and per chunk again in backward where each
    row has its own upstream gradient."""
    import coda_cute.nn as ccnn

    ran = []
    for name in ("cross_entropy_stats", "cross_entropy_stats_save", "cross_entropy_exp_save", "cross_entropy_bwd"):
        op = ccnn._OPS[name]
        monkeypatch.setitem(ccnn._OPS, name, lambda *args, _op=op, _name=name: ran.append(_name) or _op(*args))
    h = torch.randn(20, 16, generator=gen).requires_grad_()
    # a chunk of 5 tokens is rounded up to 8 (chunks start 16-byte aligned in the per-token vectors)
    loss = linear_cross_entropy(h, torch.randn(24, 16, generator=gen), torch.randint(0, 24, (20,), generator=gen),
                                reduction=reduction, save_logits=save_logits, token_chunk=None if save_logits else 5)
    loss.sum().backward()
    assert ran == want and h.grad is not None


def test_lean_head_without_gradients_makes_statistics_only(gen, monkeypatch):
    """Under no_grad (or with nothing requiring a gradient) the lean forward makes the loss alone:
    no gradient GEMMs for a backward that cannot come."""
    import coda_cute.nn as ccnn

    ran = []
    for name in ("cross_entropy_stats", "cross_entropy_stats_save"):
        op = ccnn._OPS[name]
        monkeypatch.setitem(ccnn._OPS, name, lambda *args, _op=op, _name=name: ran.append(_name) or _op(*args))
    monkeypatch.setattr(torch, "matmul", None)  # no GEMM outside the ops
    h, w = torch.randn(5, 16, generator=gen, requires_grad=True), torch.randn(24, 16, generator=gen)
    target = torch.randint(0, 24, (5,), generator=gen)
    with torch.no_grad():
        loss = linear_cross_entropy(h, w, target, save_logits=False)
    loss_plain = linear_cross_entropy(h.detach(), w, target, save_logits=False)
    assert ran == ["cross_entropy_stats"] * 2 and not loss.requires_grad
    want = torch.nn.functional.cross_entropy(h.detach() @ w.t(), target)
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss_plain, want, rtol=1e-5, atol=1e-6)


def test_cross_entropy_grad_is_the_cross_entropy_bwd_program(gen):
    """The saved-logits backward pass and the recomputing epilogue compute the same d logits."""
    h, w = torch.randn(37, 16, generator=gen), torch.randn(40, 16, generator=gen)
    target = torch.randint(-1, 40, (37,), generator=gen).float()  # -1: an ignored row (no onehot)
    logits = h @ w.t()
    lse, dloss = torch.logsumexp(logits, 1), torch.randn(37, generator=gen)
    want = cc.evaluate(library.get("cross_entropy_bwd"), h, w, {"lse": lse, "target": target, "dloss": dloss})
    torch.testing.assert_close(cross_entropy_grad(logits, lse, target, dloss), want.outputs["D"],
                               rtol=1e-5, atol=1e-6)
    assert cross_entropy_grad(logits, lse, target, dloss, out=logits) is logits  # in place, as nn runs it
    torch.testing.assert_close(logits, want.outputs["D"], rtol=1e-5, atol=1e-6)


def test_block_backward_makes_no_zero_gradients_for_its_statistics_or_scaled_input():
    """The residual GEMMs' statistics and the O projection's scaled copy of h (tokens x d) take no
    gradient: autograd must not fill zeros for them (set_materialize_grads(False))."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Fills(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.made = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(word in str(func) for word in ("zero", "fill", "full")):
                self.made.append(str(func))
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    block = LlamaBlock(64, 4, 128, n_kv_heads=2, dtype=torch.float32, max_positions=16)
    h = torch.randn(2, 16, 64, requires_grad=True)
    out, _ = block(h)
    with Fills() as fills:
        out.backward(torch.randn_like(out))
    assert fills.made == [] and h.grad is not None


@pytest.mark.parametrize("save_logits", [True, False])
def test_saved_logits_become_their_gradient_so_a_second_backward_is_refused(save_logits, gen):
    """The backward writes d logits over the saved logits (lean: scales the gradients the forward
    made, in place): a second backward through the same graph gets PyTorch's own error, never
    gradients from overwritten values."""
    h = torch.randn(5, 16, generator=gen).requires_grad_()
    loss = linear_cross_entropy(h, torch.randn(24, 16, generator=gen), torch.randint(0, 24, (5,), generator=gen),
                                save_logits=save_logits)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_saved_head_is_exact_within_its_range_and_fails_loudly_past_it():
    """The default mode stores exp(logit - target logit - EXP_SHIFT): a token whose loss is ~100
    nats gets torch's loss and gradients; one whose logit lies 200 nats over its target's (past
    the range) gets an inf loss and non-finite gradients, never finite wrong ones."""
    h = torch.eye(2, 4)
    w = torch.zeros(8, 4)
    w[1, 0], w[2, 1] = 100.0, 200.0  # row 0: a logit 100 over its target's; row 1: 200 over
    target = torch.zeros(2, dtype=torch.long)
    inside = h[:1].clone().requires_grad_()
    loss = linear_cross_entropy(inside, w, target[:1])
    ref_h = h[:1].clone().requires_grad_()
    ref = torch.nn.functional.cross_entropy(ref_h @ w.t(), target[:1])
    loss.backward()
    ref.backward()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(inside.grad, ref_h.grad)
    past = h.clone().requires_grad_()
    loss = linear_cross_entropy(past, w, target, reduction="none")
    assert loss[1] == float("inf") and loss[0].isfinite()
    loss.sum().backward()
    assert not past.grad.isfinite().all()


def test_linear_cross_entropy_rejects_bad_arguments():
    h, w = torch.randn(4, 16), torch.randn(40, 16)
    with pytest.raises(cc.ArgumentError, match=r"target must be integer class indices of shape \(4,\)"):
        linear_cross_entropy(h, w, torch.zeros(4))
    with pytest.raises(cc.ArgumentError, match=r"weight must be \(vocab, 16\)"):
        linear_cross_entropy(h, w[:, :8], torch.zeros(4, dtype=torch.long))
    with pytest.raises(cc.ArgumentError, match="reduction must be"):
        linear_cross_entropy(h, w, torch.zeros(4, dtype=torch.long), reduction="avg")
    with pytest.raises(cc.ArgumentError, match=r"target holds 40, outside \[0, 40\) and not ignore_index"):
        linear_cross_entropy(h, w, torch.full((4,), 40))
    with pytest.raises(cc.ArgumentError, match="save_logits must be True or False, got 'yes'"):
        linear_cross_entropy(h, w, torch.zeros(4, dtype=torch.long), save_logits="yes")
    for bad in (0, -4, 2.0, True):
        with pytest.raises(cc.ArgumentError, match="token_chunk must be a positive int"):
            linear_cross_entropy(h, w, torch.zeros(4, dtype=torch.long), save_logits=False, token_chunk=bad)
    with pytest.raises(cc.ArgumentError, match="pass it with save_logits=False"):
        linear_cross_entropy(h, w, torch.zeros(4, dtype=torch.long), token_chunk=2)


@pytest.mark.parametrize("save_logits", [False, True])
def test_linear_cross_entropy_compiles_with_fullgraph(save_logits, gen):
    h, w = torch.randn(12, 16, generator=gen).requires_grad_(), torch.randn(40, 16, generator=gen)
    target = torch.randint(0, 40, (12,), generator=gen)
    lean = {} if save_logits else {"token_chunk": 8}  # two chunks
    compiled = torch.compile(lambda *args: linear_cross_entropy(*args, save_logits=save_logits, **lean),
                             fullgraph=True)
    loss = compiled(h, w, target)
    loss.backward()
    h_ref = h.detach().clone().requires_grad_()
    ref = torch.nn.functional.cross_entropy(h_ref @ w.t(), target)
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h.grad, h_ref.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("tokens", [6, 30, 48, 50])
@pytest.mark.parametrize("given", ["sumsq", "nothing", "scaled"])
def test_gamma_goes_into_one_operand_and_rstd_into_the_epilogue(tokens, given, gen):
    """(h * gamma) @ w.T * rstd = rmsnorm(h) * gamma @ w.T on every route: the residual GEMM's
    h * gamma taken as it is; without statistics, one pass making rstd and h * gamma while there
    are no more tokens than twice the weight's rows (24 here), else the weight scaled; with
    statistics, the smaller operand scaled."""
    from coda_cute.nn import _norm_operands

    h = torch.randn(tokens, 16, generator=gen, dtype=torch.float64)
    w = torch.randn(24, 16, generator=gen, dtype=torch.float64)
    gamma = torch.rand(16, generator=gen, dtype=torch.float64) + 0.5
    sumsq = h.square().sum(-1) if given != "nothing" else None
    scaled = h * gamma if given == "scaled" else None
    a, b, rstd = _norm_operands(h, sumsq, gamma, w, 1e-6, scaled)
    weight_scaled = (tokens >= 24 if given == "sumsq" else tokens > 48) and given != "scaled"
    assert (a is h) == weight_scaled and (b is w) == (not weight_scaled), "gamma must scale exactly one operand"
    assert given != "scaled" or a is scaled
    want = (h * torch.rsqrt(h.square().mean(-1, keepdim=True) + 1e-6) * gamma) @ w.t()
    torch.testing.assert_close((a @ b.t()) * rstd[:, None], want.to(torch.float32).double(), rtol=1e-5, atol=1e-5)


def test_qkv_gradient_rotates_q_and_k_back_and_lays_heads_out_as_the_gemm_wrote_them(gen):
    """The transpose of the forward's rotation, per position and pair, on q and k; v as it is."""
    from coda_cute.nn import qkv_gradient

    batch, seq, hd, nq, nkv = 2, 5, 8, 3, 1
    angles = torch.rand(seq, hd // 2, generator=gen, dtype=torch.float64) * 6
    rotation = torch.polar(torch.ones_like(angles), angles)  # (seq, pairs)
    y = torch.randn(batch, seq, (nq + 2 * nkv) * hd, generator=gen, dtype=torch.float64)  # the gradient wanted
    heads = y.view(batch, seq, -1, hd // 2, 2)
    turned = torch.view_as_real(torch.view_as_complex(heads.contiguous()) * rotation[None, :, None, :])
    turned = turned.reshape(batch, seq, -1, hd).transpose(1, 2)  # as attention hands gradients back
    dq, dk = turned[:, :nq], turned[:, nq:nq + nkv]
    dv = y.view(batch, seq, -1, hd).transpose(1, 2)[:, nq + nkv:]
    q, k, v = (torch.randn_like(t) for t in (dq, dk, dv))  # the attention inputs (RoPE applied)
    d_pre, rowdot = qkv_gradient(dq, dk, dv, q, k, v, angles.cos(), angles.sin())
    torch.testing.assert_close(d_pre, y.reshape(batch * seq, -1))
    # the norm's row statistic: d_pre . pre over each token's row, pre = q, k turned back (as d_pre)
    pre, _ = qkv_gradient(q, k, v, q, k, v, angles.cos(), angles.sin())
    torch.testing.assert_close(rowdot, (d_pre * pre).sum(-1).float())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_qkv_gradient_of_16_bit_pairs_as_words_is_the_fp32_result_rounded_once(dtype, gen):
    """16-bit gradients go through 32-bit words (one pair each); the result must be the fp32
    path's, rounded once to the dtype, bit for bit, also for gradients that are views of
    one buffer as attention hands them back."""
    from coda_cute.nn import qkv_gradient

    batch, seq, hd, nq, nkv = 2, 7, 16, 4, 2
    angles = torch.rand(seq, hd // 2, generator=gen) * 6
    grads = (torch.randn(batch, seq, (nq + 2 * nkv) * hd, generator=gen) * 50).to(dtype)
    ins = torch.randn(batch, seq, (nq + 2 * nkv) * hd, generator=gen).to(dtype)

    def heads(t):
        return [x.view(batch, seq, -1, hd).transpose(1, 2) for x in t.split([nq * hd, nkv * hd, nkv * hd], -1)]
    d_pre, rowdot = qkv_gradient(*heads(grads), *heads(ins), angles.cos(), angles.sin())
    want, want_rowdot = qkv_gradient(*heads(grads.float()), *heads(ins.float()), angles.cos(), angles.sin())
    assert d_pre.dtype == dtype
    assert torch.equal(d_pre, want.to(dtype))
    torch.testing.assert_close(rowdot, want_rowdot, rtol=1e-6, atol=1e-4)
    # as the GPU runs it (ops.one_pass): traced whole, one graph, the same bits
    torch._dynamo.reset()
    traced = torch.compile(qkv_gradient, fullgraph=True, backend="aot_eager")
    d_pre_traced, _ = traced(*heads(grads), *heads(ins), angles.cos(), angles.sin())
    assert torch.equal(d_pre_traced, d_pre)


def test_pair_words_of_views_that_cannot_be_reread_as_words():
    """An odd start or an odd stride cannot be viewed as int32 words: those are copied first."""
    from coda_cute.nn import _pair_words

    buf = torch.arange(40, dtype=torch.bfloat16)
    for t in (buf[1:17], buf.view(8, 5)[:, 1:5], buf.view(4, 10)[:, :8:2], buf[:16]):
        words = _pair_words(t)
        assert words.dtype == torch.int32 and words.shape[-1] == t.shape[-1] // 2
        assert torch.equal(words.view(torch.bfloat16).reshape(t.shape), t)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("wants", ["both", "h", "weight"])
def test_lean_head_in_token_chunks_matches_autograd(reduction, wants, gen):
    """save_logits=False over chunks of 8 tokens (a ragged last one of 2) with an ignored target
    and an upstream gradient that is not 1: dh rows written per chunk, dW summed over the chunks,
    only the gradients asked for."""
    h = torch.randn(2, 9, 16, generator=gen, requires_grad=wants != "weight")
    w = (torch.randn(40, 16, generator=gen) * 0.3).requires_grad_(wants != "h")
    target = torch.randint(0, 40, (2, 9), generator=gen)
    target[0, 1] = -100
    loss = linear_cross_entropy(h, w, target, reduction=reduction, save_logits=False, token_chunk=8)
    h2, w2 = (t.detach().double().requires_grad_(t.requires_grad) for t in (h, w))  # the reference in float64
    ref = torch.nn.functional.cross_entropy((h2 @ w2.t()).flatten(0, 1), target.flatten(), reduction=reduction)
    ref = ref.reshape(2, 9) if reduction == "none" else ref
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-6)
    upstream = torch.rand(ref.shape, generator=gen, dtype=torch.float64) + 0.5
    loss.backward(upstream.float())
    ref.backward(upstream)
    for mine, theirs in ((h, h2), (w, w2)):
        assert (mine.grad is None) == (not mine.requires_grad)
        if mine.requires_grad:
            torch.testing.assert_close(mine.grad.double(), theirs.grad, rtol=1e-4, atol=1e-6)
    assert wants == "weight" or not h.grad[0, 1].any()  # the ignored row


@pytest.mark.parametrize("vocab,dtype,want", [(128256, torch.bfloat16, 768), (128256, torch.float32, 384),
                                              (32000, torch.bfloat16, 3072), (2 ** 22, torch.bfloat16, 128)])
def test_lean_token_chunk_holds_at_most_its_bytes_of_logits(vocab, dtype, want):
    from coda_cute.nn import LEAN_CHUNK_BYTES, lean_token_chunk

    chunk = lean_token_chunk(vocab, dtype)
    assert chunk == want and chunk % 128 == 0
    assert chunk * vocab * dtype.itemsize <= LEAN_CHUNK_BYTES or chunk == 128


def test_an_op_may_write_an_output_over_an_operand(gen):
    from coda_cute.ops import library_op

    op = library_op(library.get("gemm_accumulate"), overwrite={"D": "c"})
    a, b, c = (torch.randn(*shape, generator=gen) for shape in ((6, 8), (4, 8), (6, 4)))
    want = a @ b.t() + c
    assert op(a, b, c) is None
    torch.testing.assert_close(c, want)


def _saved_by_our_functions(out: torch.Tensor, exclude) -> dict:
    """{what: bytes} of the storages the modules' autograd functions keep for backward (walking
    out's graph), leaving out those of ``exclude`` (inputs, parameters, buffers)."""
    excluded = {t.untyped_storage().data_ptr() for t in exclude}
    found, stack, seen = {}, [out.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__.lstrip("_").split("Backward")[0] in ("LlamaMLPFunction", "NormQKVRope", "LinearResidual"):
            for t in node.saved_tensors:
                storage = t.untyped_storage()
                if storage.data_ptr() not in excluded:
                    found[(type(node).__name__, tuple(t.shape), t.dtype)] = storage.nbytes()
        stack += [nxt for nxt, _ in node.next_functions]
    return found


def _live_at_peak(step, exclude) -> list[tuple[int, tuple]]:
    """(elements, shape) of the tensors made during ``step()`` that are live when the most bytes
    of them are: a dispatch mode follows every op's outputs (not what runs inside our ops, which
    the kernels do in registers) while some tensor still holds their storage, leaving out the
    storages of ``exclude`` (inputs, parameters)."""
    import weakref

    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    excluded = {t.untyped_storage().data_ptr() for t in exclude}

    class Live(TorchDispatchMode):
        holders, peak, at_peak = {}, 0, []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in excluded:
                    ptr = t.untyped_storage().data_ptr()
                    alive = [ref for ref in self.holders.get(ptr, ()) if ref() is not None]
                    self.holders[ptr] = alive + [weakref.ref(t)]
            live = [next(r() for r in refs if r() is not None) for refs in self.holders.values()
                    if any(r() is not None for r in refs)]
            total = sum(t.untyped_storage().nbytes() for t in live)
            if total > self.peak:
                self.peak = total
                self.at_peak = [(t.untyped_storage().nbytes() // t.element_size(), tuple(t.shape)) for t in live]
            return out

    with Live() as live:
        step()
    return live.at_peak


@pytest.mark.parametrize("module", ["LlamaMLP", "derived chain"])
def test_mlp_backward_peak_holds_no_recomputed_activation(module):
    """At the step's memory peak (Llama's proportions: ffn = 3.5 d, here tokens = 2 d as 8192
    tokens at d = 4096), the pre-activation (its own gradient written over it) and the gate/up
    weight's gradient are live, and the recomputed SwiGLU output (tokens x ffn) is not: it is
    released before the dgrad allocates, in LlamaMLP and in a chain of two programs with derived
    backwards alike."""
    torch.manual_seed(0)
    tokens, d, ffn = 128, 64, 224
    mlp = LlamaMLP(d, ffn, dtype=torch.float32)
    h = torch.randn(2, tokens // 2, d, requires_grad=True)
    if module == "LlamaMLP":
        def forward():
            return mlp(h)[0]
    else:
        @cc.epilogue
        def rms_swiglu(acc, rstd: cc.RowVec):
            gate, up = cc.pairs(acc * rstd)
            return cc.silu(gate) * up

        chain = cc.ops.trainable_chain([rms_swiglu, library.get("residual_sumsq")], outputs=["D"])

        def forward():
            x = h.reshape(-1, d)
            rstd = torch.rsqrt(x.square().mean(-1) + mlp.eps)
            out, _ = chain(x * mlp.gamma, [mlp.w_gate_up, mlp.w_down], [{"rstd": rstd}, {"residual": x}])
            return out

    def step():
        out = forward()
        out.backward(torch.ones_like(out))

    big = sorted(shape for numel, shape in _live_at_peak(step, [h, *mlp.parameters()]) if numel >= tokens * ffn)
    assert (tokens, ffn) not in big and (tokens, 2 * ffn) in big and len(big) == 2, big


def test_mlp_backward_never_holds_the_normalized_input_beside_its_gradient():
    """The gate/up weight gradient's input x = rmsnorm(h) * gamma is made, used and released
    before the dgrad allocates dh, so the peak holds one tokens x d buffer of the two besides the
    step's output and its incoming gradient (as torch.compile's step does), not both."""
    torch.manual_seed(0)
    tokens, d, ffn = 128, 64, 224
    mlp = LlamaMLP(d, ffn, dtype=torch.float32)
    h = torch.randn(2, tokens // 2, d, requires_grad=True)

    def step():
        out = mlp(h)[0]
        out.backward(torch.ones_like(out))

    at_peak = _live_at_peak(step, [h, *mlp.parameters()])
    assert (tokens * 2 * ffn, (tokens, 2 * ffn)) in at_peak  # the weight gradient's peak
    assert sum(numel == tokens * d for numel, _ in at_peak) == 3, at_peak  # h_out, dh_out, then x or dh


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_lean_head_never_holds_more_than_a_chunk_of_logits(reduction, gen):
    """save_logits=False: no tensor of the step is larger than one chunk of logits (16 tokens x
    vocab here), in the forward-made gradients ("mean") and the recomputing backward ("none")
    alike; the default mode's step holds the whole tokens x vocab logits."""
    tokens, vocab, d, chunk = 64, 512, 8, 16
    h = torch.randn(tokens, d, generator=gen, requires_grad=True)
    w = (torch.randn(vocab, d, generator=gen) * 0.3).requires_grad_()
    target = torch.randint(0, vocab, (tokens,), generator=gen)

    def step(**lean):
        loss = linear_cross_entropy(h, w, target, reduction=reduction, **lean)
        loss.backward(torch.ones_like(loss))

    lean = _live_at_peak(lambda: step(save_logits=False, token_chunk=chunk), [h, w, target])
    assert max(numel for numel, _ in lean) <= chunk * vocab, lean
    saved = _live_at_peak(step, [h, w, target])
    assert max(numel for numel, _ in saved) >= tokens * vocab, saved


def test_modules_keep_for_backward_what_the_readme_says(gen):
    """LlamaMLP: its input h, its pre-activation z (T x 2 ffn) and rstd; LlamaAttention: rstd,
    the QKV GEMM's output and the attention output feeding the O projection (README, "Training
    with it"); besides, the block's input h and the weights."""
    d, ffn, batch, seq = 32, 48, 2, 8
    block = LlamaBlock(d, 4, ffn, n_kv_heads=2, dtype=torch.float32, max_positions=16)
    h = torch.randn(batch, seq, d, generator=gen, requires_grad=True)
    out, _ = block(h)
    saved = _saved_by_our_functions(out, [h, *block.parameters(), *block.buffers()])
    tokens, qkv, f32 = batch * seq, (4 + 2 * 2) * (d // 4), torch.float32
    assert saved == {
        ("_LlamaMLPFunctionBackward", (tokens, d), f32): tokens * d * 4,  # h after attention
        ("_LlamaMLPFunctionBackward", (tokens, 2 * ffn), f32): tokens * 2 * ffn * 4,
        ("_LlamaMLPFunctionBackward", (tokens,), f32): tokens * 4,
        ("_NormQKVRopeBackward", (tokens, qkv), f32): tokens * qkv * 4,
        ("_NormQKVRopeBackward", (tokens,), f32): tokens * 4,
        ("_LinearResidualBackward", (tokens, d), f32): tokens * d * 4,  # attention's output
    }, saved

"""LlamaMLP on a Hopper GPU: the fused kernels against fp32 autograd of the unfused block."""

import pytest
import torch

from coda_cute.nn import LlamaMLP, linear_cross_entropy, llama_mlp_reference, split_gate_up


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")]


def _rel(got, want):
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


@pytest.mark.parametrize("tokens,d,ffn", [(296, 256, 512), (1024, 512, 1376), (8, 128, 256)])
def test_llama_mlp_forward_backward_match_autograd(tokens, d, ffn):
    gen = torch.Generator().manual_seed(tokens + d)
    module = LlamaMLP(d, ffn, device="cuda")
    with torch.no_grad():
        module.gamma.copy_((torch.rand(d, generator=gen) + 0.5).cuda())
    h = torch.randn(tokens, d, generator=gen).cuda().bfloat16().requires_grad_()
    out, sumsq = module(h)
    grad = torch.randn(out.shape, generator=gen).cuda().bfloat16()
    (out.float() * grad.float()).sum().backward()

    gate, up = split_gate_up(module.w_gate_up.detach())
    params = [p.float().clone().requires_grad_() for p in (module.gamma.detach(), gate, up, module.w_down.detach())]
    h_ref = h.detach().float().requires_grad_()
    ref = llama_mlp_reference(h_ref, *params, module.eps)
    (ref * grad.float()).sum().backward()

    # bf16 storage of h_out, z, a, dz and the weight gradients: ~1 % relative error
    assert _rel(out, ref) < 1e-2
    assert _rel(sumsq, ref.detach().square().sum(-1)) < 2e-2
    assert _rel(h.grad, h_ref.grad) < 3e-2
    assert _rel(module.gamma.grad, params[0].grad) < 3e-2
    assert _rel(module.w_gate_up.grad[0::2], params[1].grad) < 3e-2
    assert _rel(module.w_gate_up.grad[1::2], params[2].grad) < 3e-2
    assert _rel(module.w_down.grad, params[3].grad) < 3e-2


def test_token_count_must_be_a_multiple_of_8():
    module = LlamaMLP(128, 256, device="cuda")
    with pytest.raises(Exception, match="multiple of 8"):
        module(torch.randn(300 + 1, 128, device="cuda", dtype=torch.bfloat16))


@pytest.mark.parametrize("batch,seq,d,heads,kv_heads,ffn", [(2, 152, 256, 4, 2, 512), (1, 512, 512, 4, 4, 1376)])
def test_llama_block_matches_autograd(batch, seq, d, heads, kv_heads, ffn):
    from coda_cute.nn import LlamaBlock, llama_attention_reference, llama_mlp_reference

    gen = torch.Generator().manual_seed(seq + d)
    block = LlamaBlock(d, heads, ffn, n_kv_heads=kv_heads, device="cuda", max_positions=seq)
    weights = {k: (torch.randn(v.shape, generator=gen) * (v.shape[-1] ** -0.5 if v.dim() == 2 else 1) +
                   (1.0 if v.dim() == 1 else 0.0)).cuda().bfloat16() for k, v in block.hf_weights().items()}
    block.load_hf(weights)
    h = torch.randn(batch, seq, d, generator=gen).cuda().bfloat16().requires_grad_()
    out, _ = block(h)
    grad = torch.randn(out.shape, generator=gen).cuda().bfloat16()
    (out.float() * grad.float()).sum().backward()

    ref_w = {k: v.float().clone().requires_grad_() for k, v in weights.items()}
    h_ref = h.detach().float().requires_grad_()
    att = block.attention
    mid = llama_attention_reference(h_ref, ref_w["input_layernorm.weight"], ref_w["self_attn.q_proj.weight"],
                                    ref_w["self_attn.k_proj.weight"], ref_w["self_attn.v_proj.weight"],
                                    ref_w["self_attn.o_proj.weight"], heads, kv_heads, att.head_dim,
                                    att.cos, att.sin, att.eps)
    ref = llama_mlp_reference(mid, ref_w["post_attention_layernorm.weight"], ref_w["mlp.gate_proj.weight"],
                              ref_w["mlp.up_proj.weight"], ref_w["mlp.down_proj.weight"], block.mlp.eps)
    (ref * grad.float()).sum().backward()
    assert _rel(out, ref) < 1.5e-2
    assert _rel(h.grad, h_ref.grad) < 4e-2
    hd = att.head_dim  # gradients in the Hugging Face layout, through the same conversions
    from coda_cute.nn import interleaved_to_rotate_half, split_gate_up

    q, k, v = att.w_qkv.grad.split([heads * hd, kv_heads * hd, kv_heads * hd])
    got = {"input_layernorm.weight": att.gamma.grad, "self_attn.q_proj.weight": interleaved_to_rotate_half(q, hd),
           "self_attn.k_proj.weight": interleaved_to_rotate_half(k, hd), "self_attn.v_proj.weight": v,
           "self_attn.o_proj.weight": att.w_o.grad, "post_attention_layernorm.weight": block.mlp.gamma.grad,
           "mlp.gate_proj.weight": split_gate_up(block.mlp.w_gate_up.grad)[0],
           "mlp.up_proj.weight": split_gate_up(block.mlp.w_gate_up.grad)[1], "mlp.down_proj.weight": block.mlp.w_down.grad}
    for key, value in got.items():
        assert _rel(value, ref_w[key].grad) < 5e-2, key


@pytest.mark.parametrize("mode", ["saved", "lean", "lean chunks", "lean chunks none"])
@pytest.mark.parametrize("tokens,d,vocab", [(296, 256, 1000), (64, 128, 4096)])
def test_linear_cross_entropy_matches_autograd(tokens, d, vocab, mode):
    """Saved logits; lean in one chunk and in chunks of 128 tokens (ragged last chunk at 296):
    gradients made in the forward for reduction "mean", and recomputed per chunk in backward for
    reduction "none" (an upstream gradient per row)."""
    gen = torch.Generator().manual_seed(tokens + vocab)
    h = (torch.randn(tokens, d, generator=gen)).cuda().bfloat16().requires_grad_()
    w = (torch.randn(vocab, d, generator=gen) * d ** -0.5 * 4).cuda().bfloat16().requires_grad_()
    target = torch.randint(0, vocab, (tokens,), generator=gen).cuda()
    target[::7] = -100
    reduction = "none" if mode.endswith("none") else "mean"
    kwargs = {} if mode == "saved" else {"save_logits": False, "token_chunk": 128 if "chunks" in mode else None}
    loss = linear_cross_entropy(h, w, target, reduction=reduction, **kwargs)
    h_ref, w_ref = h.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    ref = torch.nn.functional.cross_entropy(h_ref @ w_ref.t(), target, reduction=reduction)
    upstream = torch.rand(ref.shape, generator=gen).cuda() + 0.5  # not 1: the lean forward's gradients get scaled
    (loss * upstream).sum().backward()
    (ref * upstream).sum().backward()
    # statistics of stored bf16 logits (saved, and lean "mean", whose chunk GEMM stores them):
    # rounded to bf16 (2^-9 relative, ~0.03 at these |logits| <= ~15), as torch's bf16 logits
    # are; recomputed ("none"): fp32 inside the kernel; bf16 d logits and weights: ~1 % on gradients
    tol = 1e-3 if reduction == "none" else 5e-3
    assert ((loss.float() - ref).abs() <= tol * ref.abs().clamp_min(1.0)).all()
    assert _rel(h.grad, h_ref.grad) < 2e-2
    assert _rel(w.grad, w_ref.grad) < 2e-2


def test_linear_cross_entropy_rejects_a_vocabulary_tma_cannot_store():
    h = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1001, 128, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(Exception, match="multiple of 8, got 1001"):
        linear_cross_entropy(h, w, torch.zeros(64, dtype=torch.long, device="cuda"))


def test_llama_mlp_forward_backward_replays_in_a_cuda_graph():
    """One training step (forward + backward) captured once, replayed on new data: same
    outputs and gradients as an eager step of an identical module on that data."""
    import copy

    gen = torch.Generator().manual_seed(5)
    module = LlamaMLP(256, 512, device="cuda")
    twin = copy.deepcopy(module)
    static_h = torch.randn(296, 256, generator=gen).cuda().bfloat16().requires_grad_()
    static_grad = torch.randn(296, 256, generator=gen).cuda().bfloat16()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: kernels compiled and loaded, call plans made
        for _ in range(2):
            module.zero_grad(set_to_none=True)
            static_h.grad = None
            module(static_h)[0].backward(static_grad)
    torch.cuda.current_stream().wait_stream(side)
    module.zero_grad(set_to_none=True)
    static_h.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = module(static_h)[0]
        static_out.backward(static_grad)

    h = torch.randn(296, 256, generator=gen).cuda().bfloat16()
    grad = torch.randn(296, 256, generator=gen).cuda().bfloat16()
    with torch.no_grad():
        static_h.copy_(h)
    static_grad.copy_(grad)
    graph.replay()
    torch.cuda.synchronize()

    h_eager = h.clone().requires_grad_()
    out = twin(h_eager)[0]
    out.backward(grad)
    assert _rel(static_out, out) < 1e-3
    assert _rel(static_h.grad, h_eager.grad) < 1e-3
    for (name, p), q in zip(module.named_parameters(), twin.parameters()):
        assert _rel(p.grad, q.grad) < 1e-3, name

"""LlamaMLP on a Hopper GPU: the fused kernels against fp32 autograd of the unfused block."""

import pytest
import torch

from coda_cute.nn import LlamaMLP, llama_mlp_reference, split_gate_up


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

"""Derived backwards on a Hopper GPU: a trainable op and a three-layer chain of programs the
library does not have, in bf16, against fp32 autograd of the same math through the reference.

bf16 storage of every layer's output, saved pre-activation and gradient bounds the agreement:
relative (Frobenius) error under 1 % for outputs and 3 % for gradients, the bounds the
hand-written LlamaMLP meets (test_gpu_nn.py)."""

import pytest
import torch

from coda_cute import library
from coda_cute.ops import trainable, trainable_chain

from test_trainable import _chain_reference, bias_add, geglu, scaled_silu, soft_cap


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")]


def _rel(got, want):
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def _leaves(tensors, dtype):
    return [t.detach().to("cuda", dtype).clone().requires_grad_(True) for t in tensors]


@pytest.mark.parametrize("m,d,f", [(1000, 256, 384), (8192, 512, 1024)])
def test_three_layer_chain_in_bf16(m, d, f):
    gen = torch.Generator().manual_seed(m + d)
    x = torch.randn(m, d, generator=gen)
    weights = [torch.randn(2 * f, d, generator=gen) / d ** 0.5, torch.randn(d, f, generator=gen) / f ** 0.5,
               torch.randn(d, d, generator=gen) / d ** 0.5]
    operands = [torch.rand(m, generator=gen) + 0.5, torch.randn(d, generator=gen) * 0.1,
                torch.rand(d, generator=gen) + 0.5, torch.randn(m, d, generator=gen)]
    chain = trainable_chain([geglu, soft_cap, scaled_silu])
    mine = _leaves([x, *weights], torch.bfloat16) + _leaves(operands[:1], torch.float32) \
        + _leaves(operands[1:3], torch.bfloat16) + _leaves(operands[3:], torch.bfloat16)
    ref = _leaves([x, *weights, *operands], torch.float32)
    h, sumsq = chain(mine[0], mine[1:4], [{"rstd": mine[4]}, {"bias": mine[5]},
                                          {"scale": mine[6], "residual": mine[7]}])
    h_ref, sumsq_ref = _chain_reference(ref[0], ref[1:4], ref[4:])
    assert _rel(h, h_ref) < 1e-2 and _rel(sumsq, sumsq_ref) < 2e-2
    gh = torch.randn(h.shape, generator=gen).cuda()
    gs = torch.randn(sumsq.shape, generator=gen).cuda() / d
    ((h.float() * gh).sum() + (sumsq * gs).sum()).backward()
    ((h_ref * gh).sum() + (sumsq_ref * gs).sum()).backward()
    for name, a, b in zip("x w1 w2 w3 rstd bias scale residual".split(), mine, ref):
        assert _rel(a.grad, b.grad) < 3e-2, name
    for op in [op for op in chain.forward_ops + chain.backward_ops if op is not None]:  # kernels ran
        assert op.kernel.launches > 0, op.program.name


def test_trainable_bias_gelu_in_bf16():
    gen = torch.Generator().manual_seed(7)
    m, n, k = 777, 384, 256
    x, w, bias = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen) / 16, torch.randn(n, generator=gen)
    f = trainable(library.get("bias_gelu"))
    mine, ref = _leaves([x, w, bias], torch.bfloat16), _leaves([x, w, bias], torch.float32)
    out = f(*mine)
    want = torch.nn.functional.gelu(ref[0] @ ref[1].t() + ref[2])
    assert _rel(out, want) < 1e-2
    g = torch.randn(out.shape, generator=gen).cuda()
    (out.float() * g).sum().backward()
    (want * g).sum().backward()
    for name, a, b in zip(("x", "w", "bias"), mine, ref):
        assert _rel(a.grad, b.grad) < 3e-2, name
    assert f.chain.backward_ops[0].kernel.launches > 0


def test_chain_ending_in_a_bias_add_runs_its_last_backward_as_one_compiled_pass():
    """The last layer's backward reads only the gradient (d acc = dy, d bias = its column sums):
    an elementwise pass, compiled once for the program (ops.one_pass of its own function), matching
    fp32 autograd."""
    from coda_cute import ops

    gen = torch.Generator().manual_seed(11)
    m, d, f = 1000, 256, 384
    x, w1, w2 = torch.randn(m, d, generator=gen), torch.randn(f, d, generator=gen) / d ** 0.5, \
        torch.randn(d, f, generator=gen) / f ** 0.5
    b1, b2 = torch.randn(f, generator=gen) * 0.1, torch.randn(d, generator=gen) * 0.1
    chain = trainable_chain([soft_cap, bias_add])
    mine, ref = _leaves([x, w1, w2, b1, b2], torch.bfloat16), _leaves([x, w1, w2, b1, b2], torch.float32)
    h = chain(mine[0], mine[1:3], [{"bias": mine[3]}, {"bias": mine[4]}])
    want = (3.0 * torch.tanh((ref[0] @ ref[1].t() + ref[3]) / 3.0)) @ ref[2].t() + ref[4]
    assert _rel(h, want) < 1e-2
    g = torch.randn(h.shape, generator=gen).cuda()
    (h.float() * g).sum().backward()
    (want * g).sum().backward()
    for name, a, b in zip(("x", "w1", "w2", "b1", "b2"), mine, ref):
        assert _rel(a.grad, b.grad) < 3e-2, name
    assert ops._PASSES[chain.layers[-1].backward.fingerprint] in ops._COMPILED


def test_chain_forward_backward_replays_in_a_cuda_graph():
    """A chain's training step (its derived backward in the dgrad epilogue, the last layer's
    compiled pass) captured once and replayed on new data: the same output and gradients as an
    eager step on that data."""
    gen = torch.Generator().manual_seed(12)
    m, d, f = 296, 256, 384
    chain = trainable_chain([soft_cap, bias_add])
    params = _leaves([torch.randn(f, d, generator=gen) / d ** 0.5, torch.randn(d, f, generator=gen) / f ** 0.5,
                      torch.randn(f, generator=gen) * 0.1, torch.randn(d, generator=gen) * 0.1], torch.bfloat16)
    static_x = torch.randn(m, d, generator=gen).cuda().bfloat16().requires_grad_()
    static_g = torch.randn(m, d, generator=gen).cuda().bfloat16()

    def step():
        h = chain(static_x, params[:2], [{"bias": params[2]}, {"bias": params[3]}])
        h.backward(static_g)
        return h

    def clear():
        for t in (static_x, *params):
            t.grad = None

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: kernels compiled and loaded, the pass compiled, plans made
        for _ in range(2):
            clear()
            step()
    torch.cuda.current_stream().wait_stream(side)
    clear()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_h = step()

    x, g = torch.randn(m, d, generator=gen).cuda().bfloat16(), torch.randn(m, d, generator=gen).cuda().bfloat16()
    with torch.no_grad():
        static_x.copy_(x)
    static_g.copy_(g)
    graph.replay()
    torch.cuda.synchronize()
    graphed = [static_h.detach().clone(), *(t.grad.clone() for t in (static_x, *params))]

    eager_x = x.clone().requires_grad_()
    twins = [p.detach().clone().requires_grad_() for p in params]
    h = chain(eager_x, twins[:2], [{"bias": twins[2]}, {"bias": twins[3]}])
    h.backward(g)
    for name, a, b in zip(("h", "x", "w1", "w2", "b1", "b2"), graphed, [h, *(t.grad for t in (eager_x, *twins))]):
        assert _rel(a, b) < 1e-3, name

"""ops.trainable: any forward program as a differentiable operator, on CPU tensors (the reference
interpreter stands in for the kernels), against torch.autograd of the unfused math."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import coda_cute as cc
from coda_cute import library
from coda_cute.ops import trainable
from coda_cute.reference import evaluate_accumulator

from random_programs import random_program


def _leaf(t):
    return t.detach().clone().requires_grad_(True)


def test_bias_gelu_matches_autograd():
    gen = torch.Generator().manual_seed(0)
    x, w, bias = (torch.randn(40, 24, generator=gen), torch.randn(48, 24, generator=gen) * 0.2,
                  torch.randn(48, generator=gen))
    f = trainable(library.get("bias_gelu"))
    ours = [_leaf(t) for t in (x, w, bias)]
    theirs = [_leaf(t) for t in (x, w, bias)]
    g = torch.randn(40, 48, generator=gen)
    (f(*ours) * g).sum().backward()
    (F.gelu(theirs[0] @ theirs[1].t() + theirs[2]) * g).sum().backward()
    for a, b, name in zip(ours, theirs, "x w bias".split()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-4, msg=lambda m: f"d {name}: {m}")


def test_cross_entropy_from_its_statistics():
    """cross_entropy_stats as an op: the loss lse - target_logit is differentiable through both
    reductions, and equals F.cross_entropy's gradient."""
    gen = torch.Generator().manual_seed(1)
    h, w = torch.randn(32, 16, generator=gen), torch.randn(40, 16, generator=gen)
    target = torch.randint(0, 40, (32,), generator=gen)
    f = trainable(library.get("cross_entropy_stats"))
    ours, theirs = [_leaf(t) for t in (h, w)], [_leaf(t) for t in (h, w)]
    lse, target_logit = f(*ours, target.to(torch.int32))
    (lse - target_logit).mean().backward()
    F.cross_entropy(theirs[0] @ theirs[1].t(), target).backward()
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("seed", range(0, 40, 3))
def test_random_compositions(seed):
    """x's, w's and every operand's gradient against autograd through the reference interpreter."""
    program = random_program(seed)
    gen = torch.Generator().manual_seed(seed)
    m, n, k = 24, 32, 16
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen) * 0.3
    operands = {}
    for op in program.operands:
        cols = int(op.width * n) if op.width is not None else None
        operands[op.name] = {"row": lambda: torch.rand(m, generator=gen) + 0.5,
                             "col": lambda: torch.rand(cols, generator=gen) + 0.5,
                             "tile": lambda: torch.randn(m, cols, generator=gen),
                             "scalar": lambda: 0.75}[op.kind]()
    f = trainable(program)
    tensors = {name: _leaf(v) for name, v in operands.items() if torch.is_tensor(v)}
    xa, wa = _leaf(x), _leaf(w)
    ours = f(xa, wa, *(tensors.get(name, v) for name, v in operands.items()))
    ours = ours if isinstance(ours, tuple) else (ours,)
    xo, wo = _leaf(x), _leaf(w)
    ref_tensors = {name: _leaf(v) for name, v in tensors.items()}
    ref = cc.evaluate(program, xo @ wo.t(), torch.eye(n), {**operands, **ref_tensors}).outputs
    loss_ours = loss_ref = 0.0
    for out, got in zip(program.outputs, ours):
        if out.reduce in ("max", "maxabs"):
            assert not got.requires_grad  # statistics: no gradient (derive's convention)
            continue
        g = torch.randn(got.shape, generator=gen).bfloat16().float()
        loss_ours = loss_ours + (got.float() * g).sum()
        loss_ref = loss_ref + (ref[out.name].float() * g).sum()
    loss_ours.backward()
    loss_ref.backward()
    pairs = [("x", xa, xo), ("w", wa, wo)] + [(name, mine, ref_tensors[name]) for name, mine in tensors.items()]
    for name, mine, want in pairs:
        torch.testing.assert_close(mine.grad if mine.grad is not None else torch.zeros_like(mine),
                                   want.grad if want.grad is not None else torch.zeros_like(want),
                                   rtol=2e-4, atol=2e-4, msg=lambda msg: f"{program.name}: d {name}: {msg}")


def test_compiles_with_fullgraph():
    """Forward and backward are custom ops with fake implementations: one graph."""
    f = trainable(library.get("bias_gelu"))
    gen = torch.Generator().manual_seed(2)
    x, w, bias = torch.randn(16, 8, generator=gen), torch.randn(24, 8, generator=gen), torch.randn(24, generator=gen)

    def step(x, w, bias):
        return f(x, w, bias).square().sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    a, b = [_leaf(t) for t in (x, w, bias)], [_leaf(t) for t in (x, w, bias)]
    compiled(*a).backward()
    step(*b).backward()
    for p, q in zip(a, b):
        torch.testing.assert_close(p.grad, q.grad)


def test_bad_calls_are_coda_errors():
    f = trainable(library.get("bias_gelu"))
    x, w = torch.randn(8, 8), torch.randn(8, 8)
    with pytest.raises(cc.ArgumentError, match="missing operand"):
        f(x, w)
    with pytest.raises(cc.ArgumentError, match="expected operands"):
        f(x, w, torch.randn(8), bias=torch.randn(8))
    with pytest.raises(cc.ProgramError, match="takes a Program"):
        trainable("bias_gelu")
    with pytest.raises(cc.ProgramError, match="scalar 'alpha'"):
        trainable(library.get("alpha_beta"), wrt=["alpha"])


@cc.epilogue
def geglu(acc, rstd: cc.RowVec):
    """A GLU with a GELU gate over a row-scaled pre-activation (N/2 wide)."""
    gate, up = cc.pairs(acc * rstd)
    return cc.gelu_tanh(gate) * up


@cc.epilogue
def soft_cap(acc, bias: cc.ColVec, *, cap=3.0):
    """A soft-capped output: cap * tanh((acc + bias) / cap)."""
    return cap * cc.tanh((acc + bias) / cap)


@cc.epilogue
def scaled_silu(acc, scale: cc.ColVec, residual: cc.Tile):
    """A per-column-scaled activation plus a residual, and the rows' sums of squares."""
    h = cc.silu(acc) * scale + residual
    return {"D": h, "sumsq": cc.row_sumsq(h)}


def _chain_reference(x, weights, operands):
    rstd, bias, scale, residual = operands
    y1 = cc.evaluate(geglu, x @ weights[0].t(), torch.eye(weights[0].shape[0], device=x.device), {"rstd": rstd}).outputs["D"]
    y2 = cc.evaluate(soft_cap, y1 @ weights[1].t(), torch.eye(weights[1].shape[0], device=x.device), {"bias": bias}).outputs["D"]
    out = cc.evaluate(scaled_silu, y2 @ weights[2].t(), torch.eye(weights[2].shape[0], device=x.device),
                      {"scale": scale, "residual": residual}).outputs
    return out["D"], out["sumsq"]


def test_three_layer_chain_matches_autograd():
    """Each layer's derived backward runs in the next layer's dgrad GEMM (upstream accumulator),
    the last one recomputes its GEMM; every gradient equals autograd through the reference."""
    gen = torch.Generator().manual_seed(4)
    m, d, f = 24, 16, 32
    x = torch.randn(m, d, generator=gen)
    weights = [torch.randn(2 * f, d, generator=gen) * 0.3, torch.randn(d, f, generator=gen) * 0.3,
               torch.randn(d, d, generator=gen) * 0.3]
    operands = [torch.rand(m, generator=gen) + 0.5, torch.randn(d, generator=gen) * 0.1,
                torch.rand(d, generator=gen) + 0.5, torch.randn(m, d, generator=gen)]
    chain = cc.ops.trainable_chain([geglu, soft_cap, scaled_silu])
    assert [layer.accumulator for layer in chain.layers] == ["upstream", "upstream", "recompute"]
    # the two upstream layers write their accumulator's gradient over their saved accumulator
    assert chain.overwrites == [{"d_acc": "preact"}, {"d_acc": "preact"}, {}]
    mine = [_leaf(t) for t in (x, *weights, *operands)]
    ref = [_leaf(t) for t in (x, *weights, *operands)]
    h, sumsq = chain(mine[0], mine[1:4], [{"rstd": mine[4]}, {"bias": mine[5]},
                                          {"scale": mine[6], "residual": mine[7]}])
    h_ref, sumsq_ref = _chain_reference(ref[0], ref[1:4], ref[4:])
    torch.testing.assert_close(h, h_ref, rtol=1e-5, atol=1e-5)
    # layer 1's input (layer 0's output) is not kept: layer 0's backward rebuilds it for dW_1;
    # layer 2's is, for its GEMM again
    assert [d.recomputed for d in chain.layers] == ["D_recomputed", "D_recomputed", None]
    assert [meta is not None for meta in h.grad_fn.input_meta] == [False, True, False]
    gh, gs = torch.randn(h.shape, generator=gen), torch.randn(sumsq.shape, generator=gen)
    ((h * gh).sum() + (sumsq * gs).sum()).backward()
    ((h_ref * gh).sum() + (sumsq_ref * gs).sum()).backward()
    names = ["x", "w1", "w2", "w3", "rstd", "bias", "scale", "residual"]
    for name, a, b in zip(names, mine, ref):
        torch.testing.assert_close(a.grad, b.grad, rtol=2e-4, atol=2e-4, msg=lambda msg: f"d {name}: {msg}")


def test_chain_backward_releases_each_layer_input_after_its_weight_gradient(monkeypatch):
    """A middle layer's input (tokens x N, rebuilt in the backward) is released once its weight
    gradient is made, before the GEMMs of the layers below allocate.  (The last layer's input,
    saved by the forward for its GEMM again, autograd holds until the backward ends.)"""
    import weakref

    from coda_cute import ops

    seen, alive_at = [], []
    real = ops._weight_gradient

    def watched(d_acc, x):
        alive_at.append([ref() is not None for ref in seen])
        seen.append(weakref.ref(x))
        return real(d_acc, x)

    monkeypatch.setattr(ops, "_weight_gradient", watched)
    gen = torch.Generator().manual_seed(5)
    m, d, f = 24, 16, 32
    chain = cc.ops.trainable_chain([geglu, soft_cap, scaled_silu])
    x = torch.randn(m, d, generator=gen, requires_grad=True)
    weights = [torch.randn(2 * f, d, generator=gen) * 0.3, torch.randn(d, f, generator=gen) * 0.3,
               torch.randn(d, d, generator=gen) * 0.3]
    h, _ = chain(x, weights, [{"rstd": torch.rand(m, generator=gen) + 0.5}, {"bias": torch.zeros(d)},
                              {"scale": torch.ones(d), "residual": torch.zeros(m, d)}])
    h.sum().backward()
    # weight gradients of layers 2, 1, 0 in turn; layer 1's input was rebuilt by layer 0's backward
    assert [d.recomputed is not None for d in chain.layers] == [True, True, False]
    assert alive_at == [[], [True], [True, False]] and x.grad is not None


def test_chain_arguments_are_checked():
    chain = cc.ops.trainable_chain([soft_cap, soft_cap])
    x, w = torch.randn(8, 8), torch.randn(8, 8)
    with pytest.raises(cc.ArgumentError, match="2 layers: got 1 weights"):
        chain(x, [w], [{"bias": torch.randn(8)}, {"bias": torch.randn(8)}])
    with pytest.raises(cc.ArgumentError, match=r"layer 1 \(soft_cap\) takes operands \['bias'\]"):
        chain(x, [w, w], [{"bias": torch.randn(8)}, {}])
    with pytest.raises(cc.ProgramError, match="no tile output to pass on"):
        cc.ops.trainable_chain([library.get("cross_entropy_stats"), soft_cap])


def test_epilogue_chain_module_trains_like_the_chain():
    from coda_cute.nn import EpilogueChain

    torch.manual_seed(0)
    module = EpilogueChain([geglu, soft_cap, scaled_silu], in_features=16, features=[64, 16, 16],
                           dtype=torch.float32)
    assert [tuple(w.shape) for w in module.weights] == [(64, 16), (16, 32), (16, 16)]
    x = torch.randn(12, 16)
    operands = [{"rstd": torch.rand(12) + 0.5}, {"bias": torch.zeros(16)},
                {"scale": torch.ones(16), "residual": torch.zeros(12, 16)}]
    h, _ = module(x, operands)
    h.square().sum().backward()
    assert all(w.grad is not None and w.grad.abs().sum() > 0 for w in module.weights)
    h_ref, _ = _chain_reference(x, [w.detach() for w in module.weights],
                                [operands[0]["rstd"], operands[1]["bias"], operands[2]["scale"],
                                 operands[2]["residual"]])
    torch.testing.assert_close(h, h_ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(cc.ArgumentError, match="2 programs but 1 feature"):
        EpilogueChain([soft_cap, soft_cap], 8, [8])


def test_last_layer_without_forward_values_is_an_elementwise_pass(monkeypatch):
    """A residual add as the last layer (its sum of squares a statistic): its backward reads no
    value of the forward, so it runs over the gradient itself, no GEMM again, and as it only
    hands the gradient on (d_acc = acc in the input dtype), not even an elementwise pass;
    gradients as ever."""
    import coda_cute.ops as ops_module

    def no_pass(*args, **kwargs):
        raise AssertionError("a backward that hands the gradient on needs no elementwise pass")

    monkeypatch.setattr(ops_module, "evaluate_accumulator", no_pass)
    residual_sumsq = library.get("residual_sumsq")
    chain = cc.ops.trainable_chain([geglu, residual_sumsq], outputs=["D"])
    assert [layer.accumulator for layer in chain.layers] == ["upstream", "upstream"]
    assert chain.backward_ops[-1] is None and chain.layers[-1].upstream == ("D",)
    gen = torch.Generator().manual_seed(9)
    m, d, f = 20, 16, 32
    x, w1, w2 = torch.randn(m, d, generator=gen), torch.randn(2 * f, d, generator=gen) * 0.3, \
        torch.randn(d, f, generator=gen) * 0.3
    rstd = torch.rand(m, generator=gen) + 0.5
    mine, ref = [_leaf(t) for t in (x, w1, w2, rstd)], [_leaf(t) for t in (x, w1, w2, rstd)]
    h, sumsq = chain(mine[0], mine[1:3], [{"rstd": mine[3]}, {"residual": mine[0]}])
    assert not sumsq.requires_grad
    y1 = cc.evaluate(geglu, ref[0] @ ref[1].t(), torch.eye(2 * f), {"rstd": ref[3]}).outputs["D"]
    h_ref = y1 @ ref[2].t() + ref[0]
    g = torch.randn(h.shape, generator=gen)
    (h * g).sum().backward()
    (h_ref * g).sum().backward()
    for name, a, b in zip(("x", "w1", "w2", "rstd"), mine, ref):
        torch.testing.assert_close(a.grad, b.grad, rtol=2e-4, atol=2e-4, msg=lambda msg: f"d {name}: {msg}")


@cc.epilogue
def bias_add(acc, bias: cc.ColVec):
    """acc + bias: its backward reads only the gradient (d bias a column sum of it)."""
    return acc + bias


def test_last_layer_elementwise_pass_with_a_reduction(monkeypatch):
    """A bias add as the last layer: an elementwise pass over the gradient that also reduces its
    columns for d bias (the reference interpreter runs it); gradients as autograd's."""
    import coda_cute.ops as ops_module

    calls = []

    def counted(*args, **kwargs):
        calls.append(args[0].name)
        return evaluate_accumulator(*args, **kwargs)

    monkeypatch.setattr(ops_module, "evaluate_accumulator", counted)
    chain = cc.ops.trainable_chain([soft_cap, bias_add])
    assert [layer.accumulator for layer in chain.layers] == ["upstream", "upstream"]
    gen = torch.Generator().manual_seed(3)
    x, w1, w2 = torch.randn(12, 8, generator=gen), torch.randn(8, 8, generator=gen), torch.randn(8, 8, generator=gen)
    b1, b2 = torch.randn(8, generator=gen), torch.randn(8, generator=gen)
    mine, ref = [_leaf(t) for t in (x, w1, w2, b1, b2)], [_leaf(t) for t in (x, w1, w2, b1, b2)]
    h = chain(mine[0], mine[1:3], [{"bias": mine[3]}, {"bias": mine[4]}])
    h_ref = (3.0 * torch.tanh((ref[0] @ ref[1].t() + ref[3]) / 3.0)) @ ref[2].t() + ref[4]
    g = torch.randn(h.shape, generator=gen)
    (h * g).sum().backward()
    (h_ref * g).sum().backward()
    assert calls == ["bias_add_backward"]
    for name, a, b in zip(("x", "w1", "w2", "b1", "b2"), mine, ref):
        torch.testing.assert_close(a.grad, b.grad, rtol=2e-4, atol=2e-4, msg=lambda msg: f"d {name}: {msg}")


def test_compiled_passes_hold_more_programs_than_dynamos_recompile_limit():
    """A chain's last-layer pass is compiled once per program (on the GPU by Inductor; here the
    aot_eager backend traces the same graph): ten programs, past the 8 recompiles dynamo allows
    one code object, all compile whole (fullgraph) and equal the interpreter."""
    from torch._dynamo.utils import counters

    from coda_cute.ops import _interpreter_pass, _last_layer

    def scaled_bias(k):
        @cc.epilogue
        def scaled_bias(acc, bias: cc.ColVec):
            return acc * k + bias
        return scaled_bias

    gen = torch.Generator().manual_seed(9)
    before = counters["stats"]["unique_graphs"]
    for k in range(10):
        d = _last_layer(scaled_bias(k + 2.0), ["acc", "bias"], None)
        assert d.accumulator == "upstream" and not d.backward.operands  # d acc = k dy, d bias = column sums
        acc = torch.randn(12, 16, generator=gen)
        got = torch.compile(_interpreter_pass(d.backward), backend="aot_eager", fullgraph=True)(acc, {})
        want = evaluate_accumulator(d.backward, acc, {}).outputs
        assert got.keys() == want.keys()
        for name in want:
            torch.testing.assert_close(got[name], want[name])
    assert counters["stats"]["unique_graphs"] - before == 10


def test_plain_gemm_trains_without_a_backward_kernel():
    f = trainable(library.get("gemm"))
    assert f.chain.backward_ops == [None]
    x, w = _leaf(torch.randn(8, 16)), _leaf(torch.randn(24, 16))
    compiled = torch.compile(lambda x, w: f(x, w).square().sum(), fullgraph=True, backend="aot_eager")
    compiled(x, w).backward()
    xr, wr = _leaf(x), _leaf(w)
    (xr @ wr.t()).square().sum().backward()
    torch.testing.assert_close(x.grad, xr.grad)
    torch.testing.assert_close(w.grad, wr.grad)

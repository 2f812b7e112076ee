"""A training step of the coda_cute.nn modules through torch.compile(fullgraph=True) on the CPU:
embedding, two LlamaBlocks (attention with RoPE, MLP), the final norm and linear_cross_entropy
traced as one graph, forward and backward (the aot_eager backend traces the backward through
the ops' fake implementations, as inductor does, without compiling C++), equal to eager.
tests/test_gpu_training.py does the same with inductor and the generated kernels."""

import copy

import torch

from tiny_llama import TinyLlama, batches


def test_llama_training_step_compiles_with_fullgraph_and_matches_eager():
    torch.manual_seed(0)
    model = TinyLlama(vocab=64, d=32, heads=4, kv_heads=2, ffn=64, layers=2, seq=16)
    twin = copy.deepcopy(model)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    for inputs, targets in batches(2, 2, 16, 64):  # the second batch reuses the graph
        for m in (model, twin):
            m.zero_grad(set_to_none=True)
        loss = compiled(inputs, targets)
        loss.backward()
        want = twin(inputs, targets)
        want.backward()
        torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
        for (name, p), q in zip(model.named_parameters(), twin.parameters()):
            assert p.grad is not None, name
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_library_ops_trace_with_symbolic_sizes():
    """The ops' fake implementations size their outputs from the kernel signature with symbolic
    M and N (torch.compile(dynamic=True)): N/2-wide, N-wide and row outputs, one graph for two
    token counts."""
    from coda_cute import library
    from coda_cute.ops import library_op

    swiglu, residual = library_op(library.get("swiglu")), library_op(library.get("residual_sumsq"))

    def step(a, b, r):
        return swiglu(a, b), *residual(a, b, r)

    from torch._dynamo.utils import counters

    compiled = torch.compile(step, dynamic=True, backend="aot_eager", fullgraph=True)
    graphs = counters["stats"]["unique_graphs"]
    for tokens in (16, 24):
        a, b, r = torch.randn(tokens, 32), torch.randn(64, 32), torch.randn(tokens, 64)
        got, want = compiled(a, b, r), step(a, b, r)
        assert [t.shape for t in got] == [(tokens, 32), (tokens, 64), (tokens,)]
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w)
    assert counters["stats"]["unique_graphs"] - graphs == 1

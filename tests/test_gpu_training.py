"""Whole training steps of a small Llama model built from coda_cute.nn, on a Hopper GPU, under
the three things a training loop wraps them in: a CUDA graph (forward, backward and optimizer
step captured once, replayed on new data), FSDP2 (``fully_shard``, one process, NCCL) and
``torch.compile(fullgraph=True)`` with inductor.  Each is compared with plain eager steps of an
identical model on the same data, and each asserts that the generated kernels ran: every fused
op's ``Kernel`` counts its launches and records the path of its last call.

bf16 throughout.  The CUDA graph and FSDP2 run the same kernels on the same data as eager, so
they agree to within run-to-run noise (SDPA's backward accumulates dq with atomics): 1e-3
relative (norm of the difference over the norm).  Inductor fuses the elementwise work around
the ops and rounds to bf16 once per fused chain where eager rounds after each op, so the
compiled step gets bf16-rounding tolerances (5e-3 on the loss, 3e-2 on gradients).
tests/test_distributed.py and tests/test_nn_compile.py check the same on the CPU, fp32, exactly.
"""

import copy
import socket

import pytest
import torch

from coda_cute import nn as ccnn
from tiny_llama import TinyLlama, batches


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")]

# the shapes of test_gpu_nn.py's block test (2 x 152 tokens, d 256, 4 heads / 2 kv, ffn 512) and
# its LM head's vocabulary; every dimension a multiple of 8, so every parameter that FSDP2 lays
# into its flat all-gather buffer starts 16-byte aligned there, as TMA needs
VOCAB, D, HEADS, KV_HEADS, FFN, LAYERS, BATCH, SEQ = 1000, 256, 4, 2, 512, 2, 2, 152
DEVICE, DTYPE, LR = "cuda", torch.bfloat16, 0.1
SAME = 1e-3  # relative error between two runs of the same kernels on the same data

# fused-op launches in one training step (save_logits=True, the default): per block, the QKV
# GEMM with norm + RoPE, the O projection's residual GEMM (storing the MLP's input scaled by its
# norm's gain) and the MLP's, the gate/up GEMM with norm + SwiGLU, and in the backward the SwiGLU
# dgrad and the two norm dgrads; per step, the LM head's GEMM storing its exponentials with their row sums
PER_BLOCK = {"rms_rope_qkv": 1, "residual_sumsq_scaled": 1, "residual_sumsq": 1, "rms_swiglu_save": 1,
             "swiglu_bwd_recompute": 1, "rmsnorm_bwd_rowdot": 2}
PER_STEP = {"cross_entropy_exp_save": 1}


def _rel(got, want) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def _model() -> TinyLlama:
    torch.manual_seed(0)
    return TinyLlama(vocab=VOCAB, d=D, heads=HEADS, kv_heads=KV_HEADS, ffn=FFN, layers=LAYERS, seq=SEQ,
                     dtype=DTYPE, device=DEVICE)


def _data(steps: int, seed: int):
    return [(x.to(DEVICE), y.to(DEVICE)) for x, y in batches(steps, BATCH, SEQ, VOCAB, seed=seed)]


def _ops(model: TinyLlama) -> dict:
    att = model.blocks[0].attention
    rope = ccnn._rope_op((att.n_heads + att.n_kv_heads) * att.head_dim)  # the op this model's attention calls
    return {"rms_rope_qkv": rope, **{name: ccnn._OPS[name] for name in PER_BLOCK.keys() - {"rms_rope_qkv"}},
            **{name: ccnn._OPS[name] for name in PER_STEP}}


def _launches(model: TinyLlama) -> dict:
    return {name: op.kernel.launches for name, op in _ops(model).items()}


def _assert_kernels_ran(model: TinyLlama, before: dict, steps: int, exact: bool = True) -> None:
    """Every fused op of `steps` training steps went through its generated kernel, as often as
    the model calls it (at least that often where `exact` is False)."""
    after = _launches(model)
    for name, op in _ops(model).items():
        want = steps * (PER_BLOCK.get(name, 0) * len(model.blocks) + PER_STEP.get(name, 0))
        got = after[name] - before[name]
        assert (got == want if exact else got >= want), f"{name}: {got} kernel launches, expected {want}"
        assert op.kernel.last.path == "kernel", f"{name} ran {op.kernel.last.path!r}, not the generated kernel"


def _assert_same_step(model, loss, twin, want, tolerance, what):
    """Loss, every gradient, and every parameter after the optimizer step, against the twin's."""
    assert _rel(loss, want) < tolerance, f"{what}: loss {loss.item()} vs {want.item()}"
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        if q.grad is None:
            assert p.grad is None, name
            continue
        grad, value = p.grad, p.detach()
        if hasattr(grad, "full_tensor"):  # FSDP2: DTensor shards
            grad, value = grad.full_tensor(), value.full_tensor()
        assert _rel(grad, q.grad) < tolerance, f"{what}: gradient of {name}"
        assert _rel(value, q.detach()) < SAME, f"{what}: {name} after the step"


def test_training_step_of_two_blocks_replays_in_a_cuda_graph():
    """Forward (2 LlamaBlocks, final RMSNorm, linear_cross_entropy), backward and SGD step captured
    once, as PyTorch documents whole-network capture (warm-up on a side stream, grads set to None
    before capture so the backward allocates them from the graph's pool, static inputs); replayed
    twice on new batches copied into the static inputs, each replay against an eager step of a
    twin that starts from the same parameters."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    gen = torch.Generator().manual_seed(3)

    def hidden(batch):  # random hidden states, the batch's targets
        return torch.randn(BATCH, SEQ, D, generator=gen).to(DEVICE, DTYPE), batch[1]

    def step(m, o, h, targets):
        loss = m.hidden_loss(h, targets)  # from hidden states: the embedding's backward is not the subject
        loss.backward()
        o.step()
        return loss

    data = _data(3, seed=4)
    static_h, static_targets = hidden(data[0])

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: kernels compiled and loaded, call plans made, inductor's pass compiled
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            step(model, opt, static_h, static_targets)
    torch.cuda.current_stream().wait_stream(side)

    twin = copy.deepcopy(model)  # the parameters the captured step starts from (capture runs nothing)
    twin.zero_grad(set_to_none=True)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=LR)
    opt.zero_grad(set_to_none=True)
    before = _launches(model)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = step(model, opt, static_h, static_targets)
    _assert_kernels_ran(model, before, steps=1)  # what the graph recorded are the generated kernels

    losses = []
    for batch in data[1:]:
        h, targets = hidden(batch)
        static_h.copy_(h)
        static_targets.copy_(targets)
        graph.replay()
        twin.zero_grad(set_to_none=True)
        before = _launches(model)
        want = step(twin, twin_opt, h, targets)
        _assert_kernels_ran(model, before, steps=1)
        torch.cuda.synchronize()
        _assert_same_step(model, static_loss, twin, want, SAME, "replay")
        losses.append(static_loss.item())
    assert losses[0] != losses[1], "each replay should compute its own batch's loss"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# FSDP2 warns that a wrapped LlamaBlock returns a view (a reshape out of its autograd.Function), as
# an in-place op on it would skip the pre-backward hook; autograd refuses in-place ops on those
# views outright, so that cannot happen silently (tests/test_distributed.py)
@pytest.mark.filterwarnings("ignore:FSDP2-wrapped module")
def test_fsdp2_training_steps_match_the_plain_module(monkeypatch):
    """FSDP2 at world size 1 (NCCL, one process, initialized from env vars as torchrun would):
    every LlamaBlock and the root sharded, so parameters are DTensors, all-gathered before each
    block's forward, freed after it and gathered again for its backward; two SGD steps equal to
    the unwrapped module's."""
    import torch.distributed as dist

    fsdp = pytest.importorskip("torch.distributed.fsdp")
    if not hasattr(fsdp, "fully_shard") or not dist.is_nccl_available():
        pytest.skip("needs FSDP2 (torch.distributed.fsdp.fully_shard) and NCCL")
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "RANK": "0",
                       "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    torch.cuda.set_device(0)
    dist.init_process_group("nccl")
    try:
        model = _model()
        twin = copy.deepcopy(model)
        for block in model.blocks:
            fsdp.fully_shard(block)
        fsdp.fully_shard(model)
        assert all(type(p).__name__ == "DTensor" for p in model.parameters())
        opt, twin_opt = (torch.optim.SGD(m.parameters(), lr=LR) for m in (model, twin))
        for index, (inputs, targets) in enumerate(_data(2, seed=5)):
            for m in (model, twin):
                m.zero_grad(set_to_none=True)
            before = _launches(model)
            loss = model(inputs, targets)
            loss.backward()
            opt.step()
            _assert_kernels_ran(model, before, steps=1)
            want = twin(inputs, targets)
            want.backward()
            twin_opt.step()
            torch.cuda.synchronize()
            _assert_same_step(model, loss, twin, want, SAME, f"FSDP2 step {index}")
    finally:
        dist.destroy_process_group()


def test_training_step_compiles_with_fullgraph_and_inductor():
    """The model's forward under torch.compile(fullgraph=True) (inductor: the ops are opaque calls
    in its graph, the elementwise work around them fused), then backward and an SGD step, on two
    batches (the second reuses the compiled graphs), against eager steps of a twin."""
    model = _model()
    twin = copy.deepcopy(model)
    compiled = torch.compile(model, fullgraph=True)
    opt, twin_opt = (torch.optim.SGD(m.parameters(), lr=LR) for m in (model, twin))
    for index, (inputs, targets) in enumerate(_data(2, seed=6)):
        for m in (model, twin):
            m.zero_grad(set_to_none=True)
        before = _launches(model)
        loss = compiled(inputs, targets)
        loss.backward()
        _assert_kernels_ran(model, before, steps=1, exact=False)
        want = twin(inputs, targets)
        want.backward()
        torch.cuda.synchronize()
        assert _rel(loss, want) < 5e-3, f"step {index}: loss {loss.item()} vs {want.item()}"
        for (name, p), q in zip(model.named_parameters(), twin.parameters()):
            assert _rel(p.grad, q.grad) < 3e-2, f"step {index}: gradient of {name}"
        opt.step()
        twin_opt.step()

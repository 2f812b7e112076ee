"""Derived backward programs against torch.autograd of the forward reference.

For each forward program: the reference interpreter runs it in float64 with autograd on fresh
random inputs, the loss is sum(output * upstream) over every output, and torch.autograd gives
the gradients of the accumulator and the operands; the derived backward program, run by the
same interpreter in float64 on the same upstream gradients, must give them too, element by
element (to 1e-6: the inputs are fp32 tensors, so autograd's gradients end rounded to fp32).
"""

from __future__ import annotations

import pytest
import torch

import coda_cute as cc
from coda_cute import library
from coda_cute.config import KernelConfig
from coda_cute.derive import derive
from coda_cute.lower import lower
from coda_cute.primitives import ELEMENTWISE
from coda_cute.reference import evaluate

from random_programs import random_program

M, N = 24, 32  # N: the forward's accumulator columns
F64 = torch.float64
FORWARD_LIBRARY = ["gemm", "bias_gelu", "alpha_beta", "swiglu", "swiglu_save", "rms_swiglu_save", "residual_sumsq",
                   "rms_scale", "rms_scale_gamma", "qk_rmsnorm", "cross_entropy_stats", "cross_entropy_stats_save"]
SEGMENT_N = 256  # qk_rmsnorm's 128-column segments need wider tiles


def _identity(n):
    return torch.eye(n, dtype=torch.float32)


def _operand_values(program, m, n, gen):
    values = {}
    for op in program.operands:
        if op.kind == "scalar":
            values[op.name] = 0.5 + torch.rand((), generator=gen).item()
        elif op.kind == "row":
            values[op.name] = torch.rand(m, generator=gen) + 0.5
        elif op.kind == "col":
            values[op.name] = torch.rand(int(op.width * n), generator=gen) + 0.5
        elif op.kind == "tile":
            values[op.name] = torch.randn(m, int(op.width * n), generator=gen)
        else:
            values[op.name] = torch.randn(16, int(op.width * n) // 2, generator=gen)
    if "target" in values:  # class indices
        values["target"] = torch.randint(0, n, (m,), generator=gen).to(torch.int32)
    return values


def _check(program, seed, n=N, **options):
    gen = torch.Generator().manual_seed(seed)
    d = derive(program, **options)
    x = torch.randn(M, n, generator=gen)
    operands = _operand_values(program, M, n, gen)
    grad_inputs = {"acc": x.clone().requires_grad_(True)}
    leaves = dict(operands)
    for op in program.operands:
        if op.kind in ("row", "col", "tile") and operands[op.name].is_floating_point():
            leaves[op.name] = grad_inputs[op.name] = operands[op.name].clone().requires_grad_(True)
    forward = evaluate(program, grad_inputs["acc"], _identity(n), leaves, precision=F64)
    # bf16-exact upstream gradients: autograd rounds a gradient reaching a bf16 output to bf16,
    # which the derived program (a cast passes the gradient through) does not
    upstream = {name: torch.randn(forward.outputs[name].shape, generator=gen).bfloat16().double()
                for name in d.upstream}
    loss = sum((forward.outputs[name].float() * g).sum() for name, g in upstream.items())
    targets = list(grad_inputs)
    truth = dict(zip(targets, torch.autograd.grad(loss, [grad_inputs[t] for t in targets], allow_unused=True)))

    # the backward, on the values training would hand it
    saved = {k: v.float() for k, v in evaluate(d.forward, x, _identity(n), operands, precision=F64).outputs.items()}
    given = {}
    for op in d.backward.operands:
        if op.name.startswith("d_") and op.name[2:] in upstream:
            given[op.name] = upstream[op.name[2:]].float()  # bf16-exact
        elif op.name in operands:
            given[op.name] = operands[op.name]
        else:
            given[op.name] = saved[op.name]
    for name, value in list(given.items()):
        if any(o.name == name and o.kind == "scalar" for o in d.backward.operands) and torch.is_tensor(value):
            given[name] = value.item()
    if d.accumulator == "upstream":
        g = upstream[d.grad_of]
        result = evaluate(d.backward, g.float(), _identity(g.shape[1]), given, precision=F64)
    else:
        result = evaluate(d.backward, x, _identity(n), given, precision=F64)
    grads = d.assemble(result.outputs)

    for name in targets:
        expected = truth[name]
        if expected is None or name not in d.wrt:
            assert name not in grads or torch.count_nonzero(grads[name]) == 0, name
            continue
        got = grads.get(name, torch.zeros_like(expected))
        scale = expected.abs().max().item() + 1.0
        torch.testing.assert_close(got.double(), expected.double(), rtol=1e-6, atol=1e-6 * scale,
                                   msg=lambda m: f"{program.name}: d {name}: {m}")
    return d


@pytest.mark.parametrize("name", FORWARD_LIBRARY)
def test_library_forward_programs(name):
    program = library.get(name)
    n = SEGMENT_N if name == "qk_rmsnorm" else N
    _check(program, seed=sum(map(ord, name)), n=n)


@pytest.mark.parametrize("seed", range(40))
def test_random_compositions(seed):
    _check(random_program(seed), seed)


def test_random_compositions_recomputed():
    for seed in range(12):
        _check(random_program(seed), seed + 100, accumulator="recompute")


def test_swiglu_backward_is_the_hand_written_one():
    """The derived SwiGLU backward reads the saved pre-activation, as swiglu_bwd does, and agrees
    with it; its forward is swiglu_save's (acc stored as preact)."""
    d = derive(library.get("swiglu"))
    assert [(o.name, o.kind, o.width) for o in d.backward.operands] == [("preact", "tile", 2)]
    assert [o.name for o in d.forward.outputs] == ["D", "preact"]
    gen = torch.Generator().manual_seed(3)
    g, z = torch.randn(M, N // 2, generator=gen), torch.randn(M, N, generator=gen)
    ours = evaluate(d.backward, g, _identity(N // 2), {"preact": z}).outputs["d_acc"]
    theirs = evaluate(library.get("swiglu_bwd"), g, _identity(N // 2), {"preact": z}).outputs["D"]
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_saved_output_is_reused():
    d = derive(library.get("swiglu_save"))
    assert d.forward is d.program and d.saved_outputs == ("preact",)
    d = derive(library.get("rms_swiglu_save"))  # its preact is z = acc * rstd, not acc
    assert "preact_2" in [o.name for o in d.forward.outputs]


def test_cross_entropy_backward_from_recomputed_logits():
    """derive(cross_entropy_stats) recomputes the logits GEMM and equals cross_entropy_bwd with
    d lse = dloss and d target_logit = -dloss (the per-row loss is lse - target_logit)."""
    d = derive(library.get("cross_entropy_stats"))
    assert d.accumulator == "recompute"
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(M, N, generator=gen)
    target = torch.randint(0, N, (M,), generator=gen).to(torch.int32)
    dloss = torch.randn(M, generator=gen)
    lse = torch.logsumexp(x, 1)
    ours = evaluate(d.backward, x, _identity(N), {"lse": lse, "target": target, "d_lse": dloss,
                                                   "d_target_logit": -dloss}).outputs["d_acc"]
    theirs = evaluate(library.get("cross_entropy_bwd"), x, _identity(N),
                      {"lse": lse, "target": target, "dloss": dloss}).outputs["D"]
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_shared_gradient_is_stored_once():
    d = derive(library.get("residual_sumsq"))
    assert [o.name for o in d.backward.tile_outputs] == ["d_acc"]
    assert {g.name: g.outputs for g in d.gradients}["residual"] == ("d_acc",)


@pytest.mark.parametrize("name", ["swiglu", "bias_gelu", "residual_sumsq", "rms_swiglu_save", "cross_entropy_stats"])
def test_derived_programs_lower(name):
    """A derived backward is an ordinary program: the code generator takes it."""
    d = derive(library.get(name))
    assert lower(d.backward, KernelConfig()) is not None


def test_lowering_limits_stay_errors():
    """qk_rmsnorm's backward reduces the saved pre-activation per head: correct in the reference
    (test above), refused by sm_90a lowering (a segment reduction cannot read a tile operand)."""
    d = derive(library.get("qk_rmsnorm"))
    with pytest.raises(cc.UnsupportedError, match="segment reduction"):
        lower(d.backward, KernelConfig())


def test_refusals_name_the_problem():
    with pytest.raises(cc.ProgramError, match="table operand 'cos'"):
        derive(library.get("rope_qkv"), wrt=["acc", "cos"])
    with pytest.raises(cc.ProgramError, match="grad_of='lse' must be a tile output"):
        derive(library.get("cross_entropy_stats_save"), accumulator="upstream", grad_of="lse")
    with pytest.raises(cc.ProgramError, match="accumulator 'sideways'"):
        derive(library.get("gemm"), accumulator="sideways")
    with pytest.raises(cc.ProgramError, match="output 'R' is a col max"):
        derive(random_program(38), outputs=["D", "R"])
    with pytest.raises(cc.ProgramError, match="input 'bias2' is not one of"):
        derive(library.get("bias_gelu"), wrt=["bias2"])

    @cc.epilogue
    def gated(acc, t: cc.Tile["2N"]):
        gate, up = cc.pairs(acc)
        return {"D": gate * up, "E": cc.pairs(t)[0] * acc}

    # with the N/2-wide D's gradient as accumulator, the 2N-wide t would be 4N wide: refused
    with pytest.raises(cc.ProgramError, match=r"operand 't' is 2N wide, 4\*N in the backward"):
        derive(gated, grad_of="D")
    assert derive(gated, accumulator="recompute").accumulator == "recompute"


@cc.epilogue
def segment_stats(acc, r: cc.RowVec):
    """Segment reductions, with ties: where acc < r over a whole segment its max is r, reached
    by all eight elements (the gradient is split among them, as torch does)."""
    capped = cc.maximum(acc, r + 0.6)
    top = cc.row_max(capped, segment=8)
    spread = cc.row_logsumexp(acc, segment=8) + cc.row_sumsq(acc * r, segment=16)
    return {"D": acc * top + spread, "S": cc.row_sum(acc * top)}


def test_segment_reductions_and_ties():
    _check(segment_stats, seed=11)
    _check(segment_stats, seed=12, accumulator="recompute")


@pytest.mark.parametrize("name", ["swiglu", "bias_gelu", "cross_entropy_stats"])
def test_derived_backward_compiles_for_sm90a(name, tmp_path):
    """Derived backwards compile like hand-written ones: WGMMA mainloop, TMA stores, no spills."""
    from coda_cute.compile import compile_program

    d = derive(library.get(name))
    compiled = compile_program(d.backward, KernelConfig(), keep=("sass",), dump_dir=tmp_path / "dump",
                               source_dir=tmp_path / "src", report=True)
    sass = compiled.artifacts["sass"].read_text()
    assert "HGMMA" in sass and "UTMASTG" in sass
    assert compiled.spill_bytes == 0


def test_a_cast_that_is_only_stored_is_the_stores_own_rounding():
    """Derived backwards end in `.to(in)` before their store: rounding twice to one dtype is
    rounding once, so no separate conversion is emitted for it; a cast whose value is also
    computed with, or stored in another dtype, keeps its own."""
    from coda_cute.render import emit

    assert "round_pair(" not in emit(derive(library.get("swiglu")).backward, KernelConfig())

    @cc.epilogue
    def reused(acc):
        h = (acc * 2.0).to(cc.input_dtype)
        return {"D": h, "E": h + 1.0}

    @cc.epilogue
    def widened(acc):
        return {"D": (acc * 2.0).to(cc.input_dtype).to(cc.f32)}

    for program in (reused, widened):
        assert "round_pair(" in emit(program, KernelConfig()), program.name


@pytest.mark.parametrize("forward,hand_written", [("swiglu", "swiglu_bwd")])
def test_derived_backward_compiles_to_the_hand_written_kernels_instructions(forward, hand_written, tmp_path):
    """Same instructions, opcode by opcode, as the hand-written backward (up to a register move
    or a padding NOP): the derived program costs what it replaces, in SASS, not only in values."""
    import collections
    import re

    from coda_cute.compile import compile_program

    def opcodes(program, where):
        compiled = compile_program(program, KernelConfig(), keep=("sass",), dump_dir=tmp_path / where)
        sass = compiled.artifacts["sass"].read_text()
        return collections.Counter(re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", sass, re.M))

    derived, theirs = opcodes(derive(library.get(forward)).backward, "derived"), opcodes(library.get(hand_written), "hand")
    moves = ("MOV", "NOP")  # register moves and alignment padding: the register allocator's and assembler's choice
    assert sum(theirs.values()) > 1000
    assert {op: n for op, n in derived.items() if op not in moves} == {op: n for op, n in theirs.items() if op not in moves}
    assert abs(sum(derived.values()) - sum(theirs.values())) <= 2


def _one_op_program(name):
    """D = op(acc, y): every differentiable op of the registry on its own (positive y, x where
    the op needs a positive argument)."""
    op = ELEMENTWISE[name]

    def body(acc, y: cc.Tile):
        x = cc.sqrt(acc * acc + 0.5) if name in ("log", "sqrt", "rsqrt") else acc
        args = {1: (x,), 2: (x, y), 3: (x > y, x, y)}[op.arity]
        fn = getattr(cc, name, None) or {"add": lambda a, b: a + b, "sub": lambda a, b: a - b,
                                        "mul": lambda a, b: a * b, "div": lambda a, b: a / b,
                                        "neg": lambda a: -a, "abs": abs}[name]
        return fn(*args)

    body.__name__ = f"only_{name.rstrip('_')}"
    return cc.epilogue(body)


@pytest.mark.parametrize("name", sorted(n for n, op in ELEMENTWISE.items() if op.typing in ("arith", "float", "select")))
def test_every_differentiable_op_rule(name):
    """Each op's derivative rule (its entry in primitives.py) against autograd of its reference."""
    _check(_one_op_program(name), seed=len(name))


def test_every_op_with_a_number_result_has_a_derivative_rule():
    from coda_cute.primitives import NO_GRADIENT

    missing = [n for n, op in ELEMENTWISE.items() if op.typing not in NO_GRADIENT and op.derivative is None]
    assert not missing, f"ops without a derivative rule in primitives.py: {missing}"


def test_rebuild_output_is_for_an_upstream_accumulator():
    with pytest.raises(cc.ProgramError, match="rebuild_output=True is for accumulator='upstream'"):
        derive(library.get("swiglu"), accumulator="recompute", rebuild_output=True)
    with pytest.raises(cc.ProgramError, match="rebuild_output=True is for accumulator='upstream'"):
        derive(library.get("swiglu"), rebuild_output="yes")
    rebuilt = derive(library.get("swiglu_save"), outputs=["D"], rebuild_output=True)
    assert rebuilt.recomputed == "D_recomputed"
    assert derive(library.get("swiglu_save"), outputs=["D"]).recomputed is None

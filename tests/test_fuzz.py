"""Every public entry point, driven with malformed inputs: each call ends in a correct result or
a coda-cute error (CodaError) whose message names the argument at fault; never another
exception type.  The entry points: Kernel calls (strict and relaxed), cc.run, cc.evaluate, the
nn modules, linear_cross_entropy and the CLI."""

import math

import pytest
import torch

import coda_cute as cc
from coda_cute import cli, library
from coda_cute.errors import CodaError
from coda_cute.nn import LlamaAttention, LlamaMLP, linear_cross_entropy

M, N, K = 16, 32, 24  # a problem every check accepts (bf16 rows of 16-byte multiples)


def bf16(*shape):
    return torch.randn(*shape).bfloat16()


def malformed_tensors(shape, dtype=torch.bfloat16):
    """Wrong types, dtypes, shapes, sizes, devices and layouts for an argument of ``shape``."""
    good = torch.randn(*shape).to(dtype)
    yield "None", None
    yield "a list", good.tolist()
    yield "a string", "tensor"
    yield "a float", 1.5
    yield "int64", good.long()
    yield "bool", good > 0
    yield "float64", good.double()
    yield "an extra dim", good[None]
    yield "a dim short", good.reshape(-1)[: shape[-1]] if len(shape) > 1 else good[None, None]
    yield "zero rows", good[:0]
    yield "one column short", good[..., :-1]
    yield "meta", good.to("meta")
    yield "a strided view", torch.randn(*shape[:-1], 2 * shape[-1]).to(dtype)[..., ::2]
    yield "an offset view", torch.randn(good.numel() + 1).to(dtype)[1:].view(shape)


def scalars():
    yield "NaN", math.nan
    yield "10**400", 10**400
    yield "1e39", 1e39
    yield "True", True
    yield "a string", "1.0"
    yield "a tensor", torch.tensor(1.0)


def check(call, names: tuple[str, ...], correct=None):
    """``call()`` returns a result ``correct`` accepts, or raises a CodaError naming one of ``names``."""
    try:
        result = call()
    except CodaError as exc:
        text = str(exc)
        assert any(name in text for name in names), f"{type(exc).__name__} does not name {names}: {text}"
        return
    except Exception as exc:  # noqa: BLE001 - the point of the test
        pytest.fail(f"{type(exc).__name__} (not a coda-cute error) for arguments naming {names}: {exc}")
    if correct is not None:
        assert correct(result), f"an accepted call gave a wrong result (arguments naming {names})"


def _bias_gelu_ok(a, b, bias):
    def correct(out):
        want = torch.nn.functional.gelu(a.float() @ b.float().t() + bias.float())
        return torch.allclose(out.float(), want, rtol=2e-2, atol=2e-2)
    return correct


@pytest.mark.parametrize("strict", [True, False])
def test_kernel_calls(strict):
    program = library.get("bias_gelu")
    kernel = cc.Kernel(program, strict=strict)
    a, b, bias = bf16(M, K), bf16(N, K), bf16(N)
    for what, bad in malformed_tensors((M, K)):
        check(lambda: kernel(bad, b, bias=bias), ("A", "K="),
              correct=lambda out: isinstance(bad, torch.Tensor) and out.shape[-1] == N)
    for what, bad in malformed_tensors((N, K)):
        check(lambda: kernel(a, bad, bias=bias), ("B", "K mismatch", "K="),
              correct=lambda out: isinstance(bad, torch.Tensor) and out.shape == (M, bad.shape[0]))
    for what, bad in malformed_tensors((N,)):
        check(lambda: kernel(a, b, bias=bad), ("bias",),
              correct=lambda out: isinstance(bad, torch.Tensor) and _bias_gelu_ok(a, b, bad.float())(out))
    for what, bad in malformed_tensors((M, N)):
        check(lambda: kernel(a, b, bias=bias, out={"D": bad}), ("out", "'D'"),
              correct=lambda out: out is bad and _bias_gelu_ok(a, b, bias)(out))
    check(lambda: kernel(a, b, bias=bias, out=[bf16(M, N)]), ("out",))
    check(lambda: kernel(a, b, bias=bias, out={"E": bf16(M, N)}), ("out", "'E'"))
    check(lambda: kernel(a, b, bias=bias, return_partials="yes"), ("return_partials",))
    check(lambda: kernel(a, b), ("bias",))
    check(lambda: kernel(a, b, bias=bias, gamma=bias), ("gamma",))


def test_kernel_call_scalars():
    kernel = cc.Kernel(library.get("alpha_beta"))
    a, b, c = bf16(M, K), bf16(N, K), bf16(M, N)
    for what, bad in scalars():
        check(lambda: kernel(a, b, c=c, alpha=bad, beta=0.5), ("alpha",))
    out = kernel(a, b, c=c, alpha=math.inf, beta=0.0)  # an infinity is a number
    assert torch.isinf(out.float()).any()


def test_kernel_settings_are_checked_when_the_kernel_is_made():
    program = library.get("gemm")
    for setting, value, name in [("tile", (0, 0), "tile"), ("tile", 128, "tile"), ("cluster", (3, 1), "cluster"),
                                 ("schedule", "fast", "schedule"), ("gpu", "B200", "GPU"), ("swizzle", 3, "swizzle"),
                                 ("ab_stages", 9, "ab_stages"), ("epi_stages", "4", "epi_stages"),
                                 ("stage_tables", "yes", "stage_tables"), ("strict", 1, "strict"),
                                 ("raster_along_m", None, "raster_along_m")]:
        check(lambda: cc.Kernel(program, **{setting: value}), (name,))
    check(lambda: cc.Kernel("gemm"), ("Program",))
    check(lambda: cc.run("gemm", bf16(M, K), bf16(N, K)), ("Program",))


def test_evaluate():
    program = library.get("residual_sumsq")
    a, b, r = bf16(M, K), bf16(N, K), bf16(M, N)
    for what, bad in malformed_tensors((M, N)):
        check(lambda: cc.evaluate(program, a, b, {"residual": bad}), ("residual",),
              correct=lambda res: res.outputs["D"].shape[-1] == N)
    check(lambda: cc.evaluate(program, a, b, [r]), ("operands",))
    check(lambda: cc.evaluate(program, a, b, {"residual": r, "x": r}), ("'x'",))


def test_nn_modules():
    mlp = LlamaMLP(32, 64, dtype=torch.bfloat16)
    attention = LlamaAttention(32, 4, 2, max_positions=16, dtype=torch.bfloat16)
    for module, shape in ((mlp, (2, 8, 32)), (attention, (2, 8, 32))):
        for what, bad in malformed_tensors(shape):
            check(lambda: module(bad), ("h",), correct=lambda out: out[0].shape == bad.shape)
        for what, bad in malformed_tensors(shape[:-1], torch.float32):
            check(lambda: module(bf16(*shape), bad), ("sumsq",),
                  correct=lambda out: bad is None or out[0].shape == shape)
    check(lambda: attention(bf16(1, 24, 32)), ("max_positions", "sequence"))


def test_linear_cross_entropy():
    h, w, t = bf16(4, 8, 32), bf16(64, 32), torch.randint(0, 64, (4, 8))
    for what, bad in malformed_tensors((4, 8, 32)):
        check(lambda: linear_cross_entropy(bad, w, t), ("h", "weight", "target"), correct=lambda loss: loss.dim() == 0)
    for what, bad in malformed_tensors((64, 32)):
        check(lambda: linear_cross_entropy(h, bad, t), ("weight", "h and weight"), correct=lambda loss: loss.dim() == 0)
    for what, bad in malformed_tensors((4, 8), torch.int64):
        check(lambda: linear_cross_entropy(h, w, bad), ("target",), correct=lambda loss: loss.dim() == 0)
    check(lambda: linear_cross_entropy(h, w, t, reduction="avg"), ("reduction",))
    check(lambda: linear_cross_entropy(h, w, t, ignore_index=0.5), ("ignore_index",))
    check(lambda: linear_cross_entropy(h, w, torch.full((4, 8), 64)), ("target",))


@pytest.mark.parametrize("argv", [
    ["emit", "nope"], ["emit", "gemm", "--tile", "0x0"], ["emit", "gemm", "--tile", "big"],
    ["emit", "gemm", "--gpu", "B200"], ["emit", "gemm", "--swizzle", "3"], ["emit", "gemm", "--majors", "xx"],
    ["emit", "bias_gelu", "--operand-dtype", "bias"], ["emit", "bias_gelu", "--operand-dtype", "bias=i32"],
    ["emit", "rope_qkv", "--table-period", "cos=-1"], ["emit", "gemm", "-o", "/proc/nowhere/kernel.py"],
    ["inspect", "gemm", "--dump-dir", "/proc/nowhere"], ["show", "nope"], ["precompile"],
    ["precompile", "gemm", "--jobs", "0"], ["emit", "gemm", "--ab-stages", "99"], ["cache", "nope"],
])
def test_cli_refuses_with_one_line(argv, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip(), err

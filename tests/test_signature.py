"""The kernel's host arguments are one list (coda_cute.signature): the emitted host function,
compile's fake arguments, the runtime's call (what it allocates and the order it passes it) and
the reference interpreter's partials all agree with it, for every library program."""

import re

import pytest
import torch

from coda_cute import library
from coda_cute.arguments import TORCH_DTYPES, bind
from coda_cute.config import KernelConfig
from coda_cute.reference import evaluate_problem
from coda_cute.render import emit
from coda_cute.runtime import CallPlan
from coda_cute.signature import TILES, host_arguments

from test_compile import _lowerable


NAMES = _lowerable(KernelConfig())


def _inputs(program, m, n, k, gen):
    a, b = torch.randn(m, k, generator=gen).bfloat16(), torch.randn(n, k, generator=gen).bfloat16()
    operands = {}
    for op in program.operands:
        cols = int(n * op.width) if op.width is not None else None
        operands[op.name] = {"scalar": lambda: 0.5, "row": lambda: torch.rand(m, generator=gen) + 0.5,
                             "col": lambda: torch.rand(cols, generator=gen).bfloat16(),
                             "tile": lambda: torch.randn(m, cols, generator=gen).bfloat16(),
                             "table": lambda: torch.randn(37, 64, generator=gen)}[op.kind]()
    return a, b, operands


@pytest.mark.parametrize("name", NAMES)
def test_emitted_host_function_takes_the_signature_in_order(name):
    program = library.get(name)
    config = KernelConfig()
    source = emit(program, config)
    params = re.search(r"def __call__\(\s*self,(.*?)\):", source, re.S).group(1)
    found = [p.split(":")[0].strip() for p in params.split(",") if p.strip()]
    assert found == ["mA", "mB", *(arg.name for arg in host_arguments(program, config)[2:]), "stream"]


@pytest.mark.parametrize("name", NAMES)
def test_fake_arguments_have_the_signature_ranks(name):
    pytest.importorskip("cutlass")
    from coda_cute.compile import fake_arguments

    program = library.get(name)
    config = KernelConfig()
    fakes = fake_arguments(program, config)
    arguments = host_arguments(program, config)
    assert len(fakes) == len(arguments)
    for arg, fake in zip(arguments, fakes):
        assert (len(fake.shape) if arg.is_tensor else 0) == len(arg.dims), arg.name


@pytest.mark.parametrize("name", NAMES)
def test_call_plan_and_reference_follow_the_signature(name, gen):
    """The call passes exactly the signature's tensors, in its order and shapes (a stand-in for the
    kernel records them), and the reference interpreter's partials have the signature's shapes."""
    program = library.get(name)
    m, n, k, tile = 100, 48 if "rope" not in name and "qk" not in name else 256, 32, (64, 32)
    a, b, operands = _inputs(program, m, n, k, gen)
    problem = bind(program, a, b, operands)
    config = KernelConfig(tile=(128, 128) if "qk" in name else tile)
    seen = []
    plan = CallPlan.build(program, problem, config, lambda *args: seen.extend(args), "key")
    plan.run(a, b, operands, None, False, problem)
    arguments = host_arguments(program, config)
    assert len(seen) == len(arguments)
    free = {}
    for arg, value in zip(arguments, seen):
        if not arg.is_tensor:
            assert isinstance(value, float), arg.name
            continue
        if arg.role == "operand" and program.operand(arg.of).kind == "table":
            free = {"R": value.shape[0], "P": value.shape[1]}
        assert tuple(value.shape) == arg.shape(m, n, k, config.tile, free), arg.name
        if arg.role in ("output", "partials", "result"):
            assert value.dtype == TORCH_DTYPES[arg.dtype], arg.name
    result = evaluate_problem(problem, tile=config.tile)
    for arg in arguments:
        if arg.role == "partials":
            assert TILES in arg.dims
            assert tuple(result.partials[arg.of].shape) == arg.shape(m, n, k, config.tile), arg.name

"""The emitted kernel reads as written by hand: lines of at most 100 characters, the kernel's
named constants where it has them, and no constant arithmetic left for the reader to fold."""

import re

import pytest

from coda_cute import library
from coda_cute.config import KernelConfig
from coda_cute.errors import UnsupportedError
from coda_cute.render import emit
from coda_cute.wrap import WIDTH, fit

CONFIGS = {
    "default": KernelConfig(),
    "pingpong128x128": KernelConfig(tile=(128, 128), cluster=(1, 1), schedule="pingpong"),
    "coop128x256": KernelConfig(tile=(128, 256), cluster=(1, 2), schedule="cooperative"),
    "coop64x256": KernelConfig(tile=(64, 256), cluster=(2, 1), schedule="cooperative"),
    "rows256": KernelConfig(tile=(256, 128), cluster=(2, 1), schedule="cooperative"),
    "mk_raster_n": KernelConfig(majors="mn", raster_along_m=False, swizzle=1),
    "sm100": KernelConfig(arch="sm_100a", gpu="B200", tile=(128, 256), cluster=(1, 1)),
    "sm100_pair": KernelConfig(arch="sm_100a", gpu="B200", tile=(256, 128), cluster=(2, 1)),
    "sm100_multicast": KernelConfig(arch="sm_100a", gpu="B200", tile=(128, 256), cluster=(1, 2)),
}

# (what it is, a pattern that finds it in a line of the kernel)
RESIDUE = [
    ("a product with 0", re.compile(r"(?<![\w.])0 \* |\* 0(?![\w.])")),
    ("a sum with 0", re.compile(r"(?<![\w.])0 \+ |\+ 0(?![\w.])")),
    ("a product with 1", re.compile(r"(?<![\w.])1 \* |\* 1(?![\w.])")),
    ("a division by 1", re.compile(r"// 1(?![\w.])")),
    ("a literal subtile width", re.compile(r"\(TILE_M, [1-9]\d*\)|epi_smem_layout\([\w.]+, \d+,")),  # (a 0: a stride)
    ("a literal vector length", re.compile(r"__i\d+ < \d|MemRange\[cutlass\.\w+, \d+\], 16\]|make_layout\(\d+\)\)$")),
]


def _sources():
    for name, program in library.programs().items():
        for label, config in CONFIGS.items():
            try:
                yield f"{name}--{label}", emit(program, config)
            except UnsupportedError:
                continue


SOURCES = dict(_sources())


def test_every_library_kernel_is_emitted_at_several_configurations():
    assert len(SOURCES) >= 5 * len(library.programs())


@pytest.mark.parametrize("kernel", sorted(SOURCES))
def test_lines_fit_and_carry_no_residue(kernel):
    source = SOURCES[kernel]
    long = [f"{i}: {line}" for i, line in enumerate(source.splitlines(), 1) if len(line) > WIDTH]
    assert not long, f"{kernel}: lines over {WIDTH} characters:\n" + "\n".join(long[:5])
    for what, pattern in RESIDUE:
        found = [f"{i}: {line.strip()}" for i, line in enumerate(source.splitlines(), 1) if pattern.search(line)]
        assert not found, f"{kernel}: {what}:\n" + "\n".join(found[:5])
    compile(source, kernel, "exec")  # wrapped, it still parses


def test_wrapping_changes_only_whitespace():
    """A wrapped statement is the same Python as the long line it came from."""
    import ast

    lines = [
        ("red_x[m_block * 2 + h] = red_x[m_block * 2 + h] + where(col < N, v_a_0, 0.0)"
         " + where(col + 1 < N, v_a_1, 0.0)", 32),
        ("v_g_0 = 0.5 * v_x_0 * (1.0 + cute.math.tanh(0.7978845608028654 * (v_x_0 + 0.044715 * v_x_0"
         " * v_x_0 * v_x_0)))", 32),
        ("run_max, run_sum = logsumexp_update(run_max, run_sum, where(col + 1 < N, v_logits_1,"
         ' -float("inf")))', 32),
        ("col = col0 + tCcAcc[pair0][1]  # accumulator column of the pair's first element, and more", 32),
        ("for j in cutlass.range_constexpr(gather_subtile * (EPI_N // 8), (gather_subtile + 1)"
         " * (EPI_N // 8)):\n    pass", 24),
    ]
    for line, indent in lines:
        head, _, rest = line.partition("\n")
        wrapped = fit(head, indent)
        assert all(len(part) <= WIDTH for part in (" " * indent + wrapped).splitlines()), wrapped
        before, after = (ast.dump(ast.parse(text + ("\n" + rest if rest else "")))
                         for text in (head, "\n".join(part.strip() if k == 0 else part[indent:]
                                                      for k, part in enumerate(wrapped.splitlines()))))
        assert before == after, wrapped


def test_the_online_log_sum_exp_helpers_equal_torch_nan_and_padding_included():
    """The emitted logsumexp_update / _merge, run on numpy stand-ins that follow the hardware's
    NaN rules (min and max ignore a NaN unless told to pass it on), fold rows with -inf padding,
    rows of padding only and rows with a NaN as torch.logsumexp does, in any split of a row."""
    import math
    from types import SimpleNamespace

    import numpy as np
    import torch

    from coda_cute import epilogue, row_logsumexp

    @epilogue
    def lse(acc):
        return {"l": row_logsumexp(acc)}

    source = emit(lse, KernelConfig())
    helpers = "\n".join(re.findall(r"^def (?:where|logsumexp_\w+)\(.*?(?=^\S)", source, re.M | re.S))
    pick = lambda keep_nan, ignore: lambda x, y, propagate_nan=False, ftz=False: (  # noqa: E731
        keep_nan if propagate_nan else ignore)(np.float32(x), np.float32(y))
    math_ = SimpleNamespace(max=pick(np.maximum, np.fmax), min=pick(np.minimum, np.fmin), abs=np.abs,
                            exp=lambda x, fastmath=False: np.exp(np.float32(x)))
    namespace = {"cute": SimpleNamespace(math=math_),
                 "cutlass": SimpleNamespace(Float32=np.float32, select_=lambda c, a, b: a if c else b)}
    exec(helpers, namespace)
    update, merge = namespace["logsumexp_update"], namespace["logsumexp_merge"]
    rng = np.random.default_rng(5)
    rows = [rng.standard_normal(37) * 8, np.concatenate([rng.standard_normal(20), np.full(9, -np.inf)]),
            np.full(6, -np.inf), np.array([3.0, np.nan, -1.0]), np.array([np.nan, 2.0]), np.array([-np.inf, np.nan])]
    with np.errstate(invalid="ignore"):  # -inf - (-inf), which the kernel meets too
        for row in rows:
            want = torch.logsumexp(torch.tensor(row, dtype=torch.float64), 0).item()
            for split in (len(row), 1, 2):  # one running pair, or partials merged
                parts = []
                for start in range(0, len(row), split):
                    run = (np.float32(-np.inf), np.float32(0.0))
                    for value in row[start:start + split]:
                        run = update(*run, np.float32(value))
                    parts.append(run)
                top, total = parts[0]
                for other in parts[1:]:
                    top, total = merge(top, total, *other)
                got = (top if top != -np.inf else 0.0) + math.log(total) if total > 0 else (
                    float("nan") if np.isnan(total) else -math.inf)
                if math.isnan(want):
                    assert math.isnan(got), (row, split)
                else:
                    assert got == pytest.approx(want, rel=1e-5, abs=1e-5), (row, split)

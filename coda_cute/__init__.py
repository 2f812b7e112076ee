"""coda-cute: GEMM + epilogue programs written in Python, emitted as readable CuTe-DSL kernels.

Layers, in the order a program flows through them (one module each):

- ``frontend``   the user's contract: ``@epilogue`` functions of named operands;
- ``program``    the validated program (a typed DAG) and its fingerprint;
- ``derive``     backward programs derived from forward programs (reverse mode over the DAG);
- ``arguments``  checks of runtime tensors against a program (shared by every consumer);
- ``reference``  the pure-PyTorch interpreter: ground truth and CPU fallback;
- ``config``     what a kernel is specialized for (arch, GPU, dtypes, majors, tile, cluster);
- ``lower``      program + config -> the template's context (per-lane epilogue code);
- ``render``     the Jinja template (``templates/``) -> one standalone CuTe-DSL module;
- ``compile``    ``cute.compile`` of that module, with or without a GPU, plus PTX/SASS;
- ``cache``      compiled kernels in memory and on disk, keyed by everything that matters;
- ``runtime``    ``Kernel(program)(a, b, ...)`` on torch tensors, with argument checks;
- ``ops``        programs as torch custom ops, and trainable ops / chains with derived backwards;
- ``library``    the ready programs in ``epilogues/``;  ``cli``: the ``coda-cute`` command.
"""

from .errors import ArgumentError, CodaError, ProgramError, UnsupportedError
from .frontend import (
    ColVec, Expr, Reduction, RowVec, Scalar, Table, Tile, bf16, clamp, col_logsumexp, col_max,
    col_maxabs, col_sum, col_sumsq, epilogue, exp, f16, f32, gelu, gelu_tanh, input_dtype, interleave, log,
    maximum, minimum, pairs, reduce, relu, row_logsumexp, row_max, row_maxabs, row_sum, row_sumsq,
    rsqrt, sigmoid, silu, sqrt, square, tanh, where,
)
from .derive import derive
from .program import Program
from .reference import evaluate
from .runtime import Kernel, run
from .version import __version__

from . import ops  # noqa: E402  (cc.ops.trainable, cc.ops.trainable_chain: torch ops of programs)

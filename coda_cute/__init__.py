"""coda-cute: GEMM + epilogue programs written in Python, emitted as readable CuTe-DSL kernels.

Layers, in the order a program flows through them (one module each):

- ``primitives`` the language's elementwise ops and operand kinds, one definition each;
- ``frontend``   the user's contract: ``@epilogue`` functions of named operands;
- ``program``    the validated program (a typed DAG) and its fingerprint;
- ``arguments``  checks of runtime tensors against a program (shared by every consumer);
- ``reference``  the pure-PyTorch interpreter: ground truth and CPU fallback;
- ``config``     what a kernel is specialized for (arch, GPU, dtypes, majors, tile, cluster);
- ``lower``      program + config -> the template's context (per-lane epilogue code);
- ``render``     the Jinja template (``templates/``) -> one standalone CuTe-DSL module;
- ``compile``    ``cute.compile`` of that module, with or without a GPU, plus PTX/SASS;
- ``cache``      compiled kernels in memory and on disk, keyed by everything that matters;
- ``runtime``    ``Kernel(program)(a, b, ...)`` on torch tensors, with argument checks;
- ``library``    the ready programs in ``epilogues/``;  ``cli``: the ``coda-cute`` command.
"""

__version__ = "0.1.0"

from .errors import ArgumentError, CodaError, ProgramError, UnsupportedError
from .frontend import *  # noqa: F403 - the language: its __all__ (operators, annotations, functions)
from .program import Program
from .reference import evaluate
from .runtime import Kernel, run

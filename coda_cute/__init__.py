"""coda-cute: GEMM + epilogue programs written in Python, emitted as readable CuTe-DSL kernels.

The flow runs one way.  The package's modules, in order: the language and the ready programs,
the generator (``config`` to ``cache``: a program becomes a compiled kernel), the call side
(``arguments`` to ``runtime``: torch tensors meet the kernel) and what is built on calls (``ops``,
``nn``, ``cli``).  Each module imports only modules listed before it, never one after it
(``tests/test_layering.py`` holds the package to this list, and every module must be in it).

- ``version``, ``errors``, ``primitives``, ``program``, ``frontend``, ``derive``
                 the language: the package's version, the kinds of failure, the elementwise ops
                 and operand kinds (one definition each), the validated program (a typed DAG)
                 and its fingerprint, the user's ``@epilogue`` contract that builds one, and
                 backward programs derived from forward ones (reverse mode over the DAG); all
                 that ``import coda_cute`` loads;
- ``library``    the ready programs in ``epilogues/``, and where the shipped folders are;
- ``config``     what a kernel is specialized for (arch, GPU, dtypes, majors, tile, cluster);
- ``signature``  the kernel's host arguments in order, with dtypes and symbolic shapes (read
                 by the lowering, compile's fake arguments, the call plan and the custom ops);
- ``spelling``   CuTe-DSL spellings the lowering and the backends share (dtypes, reduction folds);
- ``backends``, ``backends.sm90``, ``backends.sm100``, ``backends.registry``
                 what a GPU generation decides (the interface), Hopper's (fragment scheme,
                 schedules, shared-memory plan, template), Blackwell's (compile-verified
                 only), and the backend of each arch;
- ``lower``      program + config -> the template's context (per-lane epilogue code, arch-neutral);
- ``wrap``       line wrapping of the emitted module (code and docstring, 100 columns);
- ``render``     the Jinja templates (``templates/``) -> one standalone CuTe-DSL module;
- ``compile``    ``cute.compile`` of that module, with or without a GPU, plus PTX/SASS;
- ``cache``      compiled kernels in memory and on disk, keyed by everything that matters, and
                 the configurations decided beside them (defaults clear of costly spills, autotuned winners);
- ``precompile`` the worker pool that fills the disk cache ahead of time;
- ``arguments``  checks of runtime tensors against a program (shared by every consumer);
- ``reference``  the pure-PyTorch interpreter: ground truth and CPU fallback;
- ``runtime``    ``Kernel(program)(a, b, ...)`` on torch tensors: the checks, the default tile,
                 cluster and schedule for a problem, and the call;
- ``ops``        programs as PyTorch custom ops (``torch.library``), for autograd and
                 ``torch.compile``, and trainable ops / chains with derived backwards;
- ``nn``         Transformer blocks (Llama MLP, attention, LM head) built on those ops;
- ``cli``        the ``coda-cute`` command.
"""

from .errors import ArgumentError, CodaError, ProgramError, UnsupportedError
from .frontend import *  # noqa: F403 - the language: its __all__ (operators, annotations, functions)
from .derive import derive
from .program import Program
from .version import __version__

# Python runs this file before any module of the package, and importing a module must load
# nothing listed after it: Kernel, run, evaluate and ops (the call side, with torch and the
# whole generator behind it) are imported when first used.
_CALL_SIDE = ("Kernel", "evaluate", "ops", "run")


def __getattr__(name: str):
    if name not in _CALL_SIDE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import coda_cute.ops  # sets the package's `ops` (`from . import ops` would first ask this function)
    from . import reference, runtime

    globals().update(Kernel=runtime.Kernel, run=runtime.run, evaluate=reference.evaluate)
    return globals()[name]


def __dir__() -> list[str]:
    return sorted({*globals(), *_CALL_SIDE})

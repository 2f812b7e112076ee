"""Compiling emitted kernels with CuTe DSL, with or without a GPU.

``compile_source`` imports the exact source ``emit`` produced (written to a file, so
tracebacks and the DSL's source locations point at it) and calls ``cute.compile`` on fake
tensors: dynamic M, N, K with N and K multiples of 8, 16-byte aligned bases.  The arch
comes from the config (``--gpu-arch``), so this works on a CPU-only machine.  Artifacts
(PTX, cubin, SASS via nvdisasm) are kept on request.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import importlib.util
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path

from .config import KernelConfig
from .errors import UnsupportedError
from .lower import lower
from .primitives import OPERAND_KINDS
from .program import Program
from .render import render
from .signature import host_arguments
from .spelling import CUTE_DTYPES, DTYPE_BYTES


@dataclass
class CompiledKernel:
    """A compiled kernel plus what it was built from."""

    program: Program
    config: KernelConfig
    source: str
    function: object  # the callable cute.compile returned
    module: object  # the emitted module, imported
    compile_seconds: float
    artifacts: dict = field(default_factory=dict)  # 'ptx' / 'cubin' / 'sass' -> Path
    report: str = ""  # ptxas' register / spill report, when asked for
    #: local memory per thread of its largest kernel, from the cubin (None: not found there): where
    #: ptxas puts spilled registers, and 0 exactly when nothing spills (the kernels have no local
    #: arrays or calls); free to read, unlike ``spill_bytes``, which needs ``report``
    stack_frame_bytes: int | None = None
    #: SASS instructions of its largest kernel (the GEMM), from the cubin (None: not found there)
    instructions: int | None = None
    #: loads and stores of local memory (LDL, STL) in its largest kernel's SASS, from the cubin
    #: (None: not found there): how often spill code runs per tile, its epilogue being unrolled
    local_accesses: int | None = None

    @property
    def registers(self) -> int | None:
        found = re.findall(r"Used (\d+) registers", self.report)
        return max(map(int, found)) if found else None

    @property
    def spill_bytes(self) -> int | None:
        found = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", self.report)
        return sum(int(x) + int(y) for x, y in found) if found else None


def import_source(source: str, directory: Path):
    """Import emitted source as a module, from a file in ``directory`` named after its hash (the
    DSL reads a kernel's source from its file while compiling it)."""
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"kernel_{digest}.py"
    if not path.exists():
        tmp = path.with_suffix(".tmp")
        tmp.write_text(source)
        os.replace(tmp, path)
    name = f"coda_cute_kernel_{digest}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def fake_arguments(program: Program, config: KernelConfig) -> list:
    """Fake tensors / scalars for the host function's parameters, in its order.

    Sizes are dynamic; rows may be padded (any 16-byte aligned row stride), so callers
    can pass views into larger buffers.  One symbol per extent (M, N, K, N/2, 2N), so a
    TVM-FFI call checks that tensors agree on it.
    """
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    def dtype(name: str):
        return getattr(cutlass, CUTE_DTYPES[name])

    def matrix(dt: str, rows, cols, row_major: bool = True, align: int = 16):
        per_16_bytes = 16 // DTYPE_BYTES[dt] if align == 16 else 1
        lead = cute.sym_int64(divisibility=per_16_bytes)
        stride = (lead, 1) if row_major else (1, lead)
        return make_fake_tensor(dtype(dt), (rows, cols), stride, assumed_align=align)

    m, n, k = cute.sym_int(), cute.sym_int(divisibility=8), cute.sym_int(divisibility=8)
    cols = {Fraction(1, 2): cute.sym_int(divisibility=8), Fraction(1): n, Fraction(2): cute.sym_int(divisibility=8)}
    periods = dict(config.table_periods)

    def extent(dim, arg):
        """One symbol per extent (``signature``): M, N, K, a width's columns, a period baked in, else any."""
        if isinstance(dim, Fraction):
            return cols[dim]
        if dim in ("M", "N", "K"):
            return {"M": m, "N": n, "K": k}[dim]
        if isinstance(dim, int):
            return dim
        return periods[arg.of] if dim == "P" and arg.of in periods else cute.sym_int()  # TILES, BLOCKS, R, P

    args = []
    for arg in host_arguments(program, config):
        shape = [extent(dim, arg) for dim in arg.dims]
        if arg.role == "scalar":
            args.append(cutlass.Float32(1.0))
        elif arg.role in ("a", "b"):
            args.append(matrix(arg.dtype, *shape, config.majors[arg.role == "b"] == "k"))
        elif arg.role == "output":
            args.append(matrix(arg.dtype, *shape))
        elif arg.role == "partials" and len(shape) == 3:  # a log-sum-exp's (2, tiles, length)
            args.append(make_fake_tensor(cutlass.Float32, tuple(shape), (cute.sym_int64(), cute.sym_int64(), 1),
                                         assumed_align=4))
        elif arg.role == "partials":
            args.append(matrix("f32", *shape, align=4))
        elif len(shape) == 1:  # finished values, arrival counters, row and column vectors
            args.append(make_fake_tensor(dtype(arg.dtype), tuple(shape), (1,), assumed_align=DTYPE_BYTES[arg.dtype]))
        else:  # TMA reads a ring's operand: 16-byte aligned rows and base
            ring = OPERAND_KINDS[program.operand(arg.of).kind].staging == "ring"
            args.append(matrix(arg.dtype, *shape, align=16 if ring else DTYPE_BYTES[arg.dtype]))
    return args


def compile_source(source: str, program: Program, config: KernelConfig, *, keep: tuple[str, ...] = (),
                   dump_dir: Path | None = None, source_dir: Path | None = None,
                   tvm_ffi: bool = False, report: bool = False) -> CompiledKernel:
    """``cute.compile`` the emitted ``source``; ``keep`` any of 'ptx', 'cubin', 'sass'.

    With ``tvm_ffi`` the result takes torch tensors directly and launches on the current
    torch stream (the runtime's path); without, cute tensors and an explicit stream.
    ``report`` captures ptxas' register and spill report.  The source is imported from
    ``source_dir``, or from a temporary folder removed once the kernel is compiled.
    """
    if source_dir is None:
        with tempfile.TemporaryDirectory(prefix="coda_cute_src_") as tmp:
            compiled = compile_source(source, program, config, keep=keep, dump_dir=dump_dir, source_dir=Path(tmp),
                                      tvm_ffi=tvm_ffi, report=report)
        sys.modules.pop(compiled.module.__name__, None)  # its file is gone: nothing may import it again
        return compiled
    module = import_source(source, source_dir)
    import cutlass.cute as cute
    from cutlass.runtime import make_fake_stream

    kernel_class = next(v for k, v in vars(module).items() if k.endswith("Kernel") and isinstance(v, type))
    args = fake_arguments(program, config)
    options = f"--gpu-arch {config.arch}"
    stream = make_fake_stream(use_tvm_ffi_env_stream=tvm_ffi)
    if tvm_ffi:
        options += " --enable-tvm-ffi"
    if report:
        options += " remarks{ptx}"
    captured = io.StringIO()
    with contextlib.ExitStack() as scratch:
        # the cubin is always kept (in memory, and in dump_dir): its stack frame sizes are free to
        # read, where ptxas' report (remarks) makes compiles up to 3x slower
        if keep:
            dump_dir = Path(dump_dir or tempfile.mkdtemp(prefix="coda_cute_dump_"))
            dump_dir.mkdir(parents=True, exist_ok=True)  # CuTe DSL fails if it does not exist
            options += " --keep-ptx"
        else:
            dump_dir = Path(scratch.enter_context(tempfile.TemporaryDirectory(prefix="coda_cute_cubin_")))
        options += f" --keep-cubin --dump-dir {dump_dir}"
        start = time.perf_counter()
        with contextlib.redirect_stdout(captured), contextlib.redirect_stderr(captured):
            function = cute.compile(kernel_class(), *args, stream, options=options)
        seconds = time.perf_counter() - start
    compiled = CompiledKernel(program, config, source, function, module, seconds, report=captured.getvalue(),
                              stack_frame_bytes=stack_frame_bytes(function.__cubin__),
                              instructions=kernel_instructions(function.__cubin__),
                              local_accesses=local_accesses(function.__cubin__))
    if keep:
        compiled.artifacts = _collect(dump_dir, keep)
    return compiled


def compile_program(program: Program, config: KernelConfig | None = None, **kwargs) -> CompiledKernel:
    """Lower, render and compile ``program`` (see ``compile_source``)."""
    config = config or KernelConfig()
    source = render(lower(program, config))
    return compile_source(source, program, config, **kwargs)


_EIFMT_SVAL = 4  # an .nv.info record whose 16-bit field is the size of the value that follows
_EIATTR_FRAME_SIZE = 0x11  # its value: (ELF symbol index, stack frame bytes) of one function


def _elf_sections(cubin: bytes | None) -> list[tuple[bytes, int, int]] | None:
    """(name, offset, size) of each section of ``cubin``; None if it is not a 64-bit little-endian
    ELF file or its section table cannot be read."""
    if not cubin or cubin[:6] != b"\x7fELF\x02\x01":
        return None
    try:
        (table_at,) = struct.unpack_from("<Q", cubin, 0x28)
        entry_size, count, names_index = struct.unpack_from("<HHH", cubin, 0x3A)
        # Elf64_Shdr: name, (type, flags, addr), offset, size
        sections = [struct.unpack_from("<I20xQQ", cubin, table_at + i * entry_size) for i in range(count)]
        names_at = sections[names_index][1]
        return [(cubin[names_at + name:cubin.index(b"\0", names_at + name)], offset, size)
                for name, offset, size in sections]
    except (struct.error, ValueError, IndexError):
        return None


def stack_frame_bytes(cubin: bytes | None) -> int | None:
    """The largest stack frame (local memory per thread) among the functions of ``cubin``, from
    the EIATTR_FRAME_SIZE records of its ``.nv.info`` sections (what ``ptxas -v`` prints as
    "bytes stack frame"); None if it has none, or is not a 64-bit little-endian ELF file."""
    frames = []
    try:
        for name, offset, size in _elf_sections(cubin) or []:
            if not name.startswith(b".nv.info"):
                continue
            at = offset
            while at + 4 <= offset + size:  # records: format, attribute, a 16-bit value or size
                fmt, attribute, value = struct.unpack_from("<BBH", cubin, at)
                at += 4
                if fmt == _EIFMT_SVAL:
                    if attribute == _EIATTR_FRAME_SIZE and value == 8:
                        frames.append(struct.unpack_from("<I", cubin, at + 4)[0])
                    at += value
    except struct.error:
        return None
    return max(frames) if frames else None


def _largest_text(cubin: bytes | None) -> tuple[int, int] | None:
    """(offset, size) of the largest function's code in ``cubin`` (the GEMM kernel: a finishing
    kernel is far smaller); None if it has none, or is not a 64-bit little-endian ELF file."""
    texts = [(size, offset) for name, offset, size in _elf_sections(cubin) or [] if name.startswith(b".text.")]
    return max(texts)[::-1] if texts else None


def kernel_instructions(cubin: bytes | None) -> int | None:
    """SASS instructions in the largest function of ``cubin``, from its ``.text`` section's size
    (16 bytes an instruction on sm_90 and sm_100); None where ``_largest_text`` finds none."""
    text = _largest_text(cubin)
    return text[1] // 16 if text else None


#: opcodes of STL and LDL, the stores and loads of local memory (where ptxas puts spilled
#: registers), in the low 12 bits of an instruction's first 8 bytes on sm_90 (tests/test_compile.py
#: checks the count against nvdisasm's; no sm_100a kernel of the library spills to check it there)
_LOCAL_MEMORY_OPCODES = (0x387, 0x983)


def local_accesses(cubin: bytes | None) -> int | None:
    """STL and LDL instructions in the largest function of ``cubin``; None where
    ``_largest_text`` finds none."""
    text = _largest_text(cubin)
    if text is None:
        return None
    offset, size = text
    words = struct.unpack_from(f"<{size // 8}Q", cubin, offset)[::2]  # each instruction's first 8 bytes
    return sum(1 for word in words if (word & 0xFFF) in _LOCAL_MEMORY_OPCODES)


def _collect(dump_dir: Path, keep: tuple[str, ...]) -> dict:
    found = {}
    for suffix, key in ((".ptx", "ptx"), (".cubin", "cubin")):
        files = sorted(dump_dir.glob(f"*{suffix}"), key=lambda p: p.stat().st_mtime)
        if files:
            found[key] = files[-1]
    if "sass" in keep:
        if "cubin" not in found:
            raise UnsupportedError(f"no cubin was kept in {dump_dir}; cannot disassemble")
        found["sass"] = disassemble(found["cubin"])
    return found


def nvdisasm_path() -> str:
    """nvdisasm from the nvidia-cuda-nvdisasm wheel, else from PATH."""
    try:
        import nvidia.cu13 as cu13  # the wheel's layout: nvidia/cu13/bin/nvdisasm

        candidate = Path(next(iter(cu13.__path__))) / "bin" / "nvdisasm"
        if candidate.exists():
            return str(candidate)
    except ImportError:
        pass
    found = shutil.which("nvdisasm")
    if not found:
        raise UnsupportedError("nvdisasm not found: pip install nvidia-cuda-nvdisasm (the 'test' extra) to get SASS")
    return found


def disassemble(cubin: Path) -> Path:
    sass = cubin.with_suffix(".sass")
    result = subprocess.run([nvdisasm_path(), "-c", str(cubin)], capture_output=True, text=True)
    if result.returncode != 0:
        raise UnsupportedError(f"nvdisasm failed on {cubin.name}: {result.stderr.strip()[:500]}")
    sass.write_text(result.stdout)
    return sass

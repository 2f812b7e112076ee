"""Running programs on PyTorch tensors.

    kernel = coda_cute.Kernel(program)            # or coda_cute.run(program, a, w, ...)
    out = kernel(a, w, residual=r)                # CUDA tensors: the generated kernel

CUDA tensors run the generated kernel for the GPU they live on; CPU tensors run the reference
interpreter (the documented CPU fallback).  Both paths check a call the same way, once per
signature (``Kernel.plan``): the arguments against the program (``arguments.bind``,
``check_outputs``), then the kernel's layout rules (``check_kernel_arguments``) and everything
lowering would refuse.  So a call that works on the CPU works on the GPU, and a tensor the
kernel cannot take is rejected with an ArgumentError, never silently computed another way.
``Kernel(program, strict=False)`` relaxes the kernel's rules on CPU tensors for prototyping
(fp32 A and B, any N and K, unaligned views): then only the reference's own checks apply.

Outputs are allocated unless passed in ``out={name: tensor}``: written in place and returned
as given (views into larger buffers are fine: only the row stride must be 16-byte aligned).
Reductions come back finished; ``return_partials=True`` adds the per-tile partials.  Without
it the partials are scratch, which each call plan keeps and reuses on the CUDA stream it made
them on (``CallPlan.scratch``).  A second kernel folds them over the tiles, except in calls too
small to keep the GPU busy (``host_bound``): there the GEMM's last tile of each row or column of
tiles folds them, counting tiles in with counters kept beside the partials (one launch less per
call; ``KernelConfig.finish_in_gemm``).

Tile, cluster and schedule left unset are chosen by rules measured on the library
(``default_tile``); where the rules' kernel spills registers, or is one whose epilogue runs
latency-bound (``cache.latency_bound``), a GPU call runs the first fallback that is neither
(``cache.get_default_kernel``: the cubin's stack frame and SASS, read at compile time; the
decision is cached beside the kernels).  Settings the caller fixed are built as given, with a
SpillWarning where they spill.  ``Kernel(program, autotune=True)`` times a few candidates on the
first GPU call of each shape instead and runs the fastest (``cache.get_tuned_kernel``; the winner
is cached beside the kernels, so a later process starts with it).
"""

from __future__ import annotations

import math
import threading
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from . import reference
from .arguments import Problem, _aligned, _row_stride_ok, bind, check_kernel_arguments, check_outputs
from .arguments import TORCH_DTYPES, short_dtype
from .backends.registry import BACKENDS, backend
from .config import DEFAULT_GPUS, DEFAULT_SWIZZLE, GPU_ARCHS, GPUS, KernelConfig, unrolled_subtiles
from .errors import ArgumentError, ProgramError, UnsupportedError
from .lower import fits_shared_memory, lower, tables_in_segment_reductions
from .primitives import check_scalar
from .program import Program
from .signature import host_arguments
from .spelling import DTYPE_BYTES

if TYPE_CHECKING:
    from .cache import CacheEntry

_GPU_NAMES = {"H200": "H200", "H100 PCIe": "H100-PCIe", "H100": "H100", "H800": "H800", "H20": "H20",
              "GB200": "GB200", "B200": "B200"}


class SpillWarning(UserWarning):
    """The kernel of a configuration the caller fixed spills registers (slower, still correct)."""


@dataclass(frozen=True)
class Launch:
    """What the last call ran (tests use it to prove the generated kernel ran)."""

    path: str  # "kernel" or "reference"
    config: KernelConfig | None  # the kernel checked for (None on CPU with strict=False)
    key: str | None  # the cache key of the kernel that ran (None on the reference path)


class Kernel:
    """``program`` compiled for a family of configurations, callable on torch tensors.

    ``strict`` (default True): CPU tensors are held to the GPU kernel's rules (see the module
    docstring); False lets the reference run whatever it can, for prototyping.

    ``autotune`` (default False): the first GPU call of each (M, N, K) compiles the candidates of
    ``cache.tune_candidates`` that the generator can build (seconds each, once: they go to the
    disk cache), times those that do not spill on the call's own tensors (about
    ``cache.TUNE_BUDGET_S`` seconds in all; outputs go to scratch tensors, so operands an op
    writes over are not touched) and runs the fastest from then on, in this process and, through
    the disk cache, in later ones.  It chooses tile, cluster and schedule, so it takes none of
    them; CPU calls ignore it.

    ``arch`` (default: that of the GPU named by ``gpu``, else the device's; on the CPU sm_90a):
    the kernels' target, ``"sm_90a"`` or ``"sm_100a"`` (Blackwell: compile-verified only, see
    the README's limits).  A GPU call refuses a device of another arch before anything launches;
    a CPU call is checked against that arch's kernel (what it refuses, the CPU refuses too)."""

    def __init__(self, program: Program, *, tile: tuple[int, int] | None = None,
                 cluster: tuple[int, int] | None = None, schedule: str | None = None, gpu: str | None = None,
                 ab_stages: int = 0, epi_stages: int = 0, in_stages: int = 0,
                 raster_along_m: bool = True, swizzle: int = DEFAULT_SWIZZLE, stage_tables: bool | None = None,
                 finish_in_gemm: bool | None = None, unroll_subtiles: bool | None = None, strict: bool = True,
                 autotune: bool = False, arch: str | None = None):
        if not isinstance(program, Program):
            raise ProgramError(f"Kernel needs a coda_cute Program (@coda_cute.epilogue), got {type(program).__name__}")
        if any(v is not None and type(v) is not bool for v in (stage_tables, finish_in_gemm, unroll_subtiles)) \
                or type(strict) is not bool or type(autotune) is not bool:
            raise UnsupportedError(f"stage_tables, finish_in_gemm and unroll_subtiles must be None, True or False, "
                                   f"strict and autotune True or False, got {stage_tables!r}, {finish_in_gemm!r}, "
                                   f"{unroll_subtiles!r}, {strict!r} and {autotune!r}")
        if autotune and (tile, cluster, schedule, unroll_subtiles) != (None, None, None, None):
            raise UnsupportedError("autotune=True chooses the tile, cluster and schedule (and the subtile loop's form) "
                                   f"by timing them: leave them unset (got tile={tile}, cluster={cluster}, "
                                   f"schedule={schedule}, unroll_subtiles={unroll_subtiles})")
        self.autotune = autotune
        _check_settings(tile, cluster, schedule, gpu, ab_stages, epi_stages, in_stages, raster_along_m, swizzle,
                        arch)
        self.arch = arch if arch is not None else GPU_ARCHS[gpu] if gpu is not None else None
        self.program, self.strict = program, strict
        self.tile, self.cluster, self.schedule, self.gpu = tile, cluster, schedule, gpu
        # mainloop stages and epilogue ring depths; 0: planned from the shared memory (KernelConfig)
        self.ab_stages, self.epi_stages, self.in_stages = ab_stages, epi_stages, in_stages
        self.raster_along_m, self.swizzle = raster_along_m, swizzle  # tile order (KernelConfig)
        # Table operands through smem by TMA (KernelConfig.stage_tables). None: wherever the call's
        # tables allow it (stageable_tables), else gathered; True: required (a table that cannot
        # be staged is an ArgumentError); False: always gathered
        self.stage_tables = stage_tables
        # reductions folded by the GEMM's last tiles (KernelConfig.finish_in_gemm). None: in calls
        # too small to keep the GPU busy (host_bound), else by a second kernel; True, False: always
        self.finish_in_gemm = finish_in_gemm
        # the epilogue's subtile loop unrolled while tracing (KernelConfig.unroll_subtiles). None:
        # for ping-pong kernels of calls that keep the GPU busy (config.unrolled_subtiles), else a
        # loop LLVM unrolls, and the other form where that spills; True, False: always, built as
        # given like a fixed tile (kernel_for)
        self.unroll_subtiles = unroll_subtiles
        self.launches = 0
        self.last: Launch | None = None
        self._plans: dict = {}

    def config_for(self, problem: Problem) -> KernelConfig:
        """The configuration this call needs (specializes on dtypes, majors and GPU): with tile,
        cluster and schedule as fixed, or, where none is, as the rules choose (``default_tile``),
        which a GPU call runs unless its kernel spills or runs latency-bound
        (``cache.get_default_kernel``)."""
        a, b = problem.a, problem.b
        majors = ("k" if a.stride(1) == 1 else "m") + ("k" if b.stride(1) == 1 else "n")
        operand_dtypes = tuple(
            (name, short_dtype(t.dtype)) for name, t in problem.operands.items() if isinstance(t, torch.Tensor)
        )
        table_periods = tuple((op.name, int(problem.operands[op.name].shape[1]))
                              for op in self.program.operands if op.kind == "table")
        # the arch asked for, or the one of the GPU named, or of the device (CPU: Hopper's)
        arch = self.arch or (device_arch(a.device) if a.is_cuda else KernelConfig.arch)
        gpu = self.gpu or (gpu_model(a.device, arch) if a.is_cuda else DEFAULT_GPUS[arch])
        small = host_bound(self.program, problem, arch)
        tile, cluster, schedule = fill_config(self.program, problem.m, problem.n, self.tile, self.cluster,
                                              self.schedule, arch, GPUS[gpu], problem.k, small)
        staged = self.stage_tables is not False and any(op.kind == "table" for op in self.program.operands)
        if staged:
            reason = stageable_tables(self.program, problem, backend(arch).cta_tile(tile)[0])
            if reason and self.stage_tables:
                raise ArgumentError(f"{reason} (or stage_tables=False: gathered)")
            staged = reason is None
        config = KernelConfig(
            arch=arch, gpu=gpu, dtype=short_dtype(a.dtype), majors=majors,
            tile=tuple(tile), cluster=tuple(cluster), schedule=schedule,
            ab_stages=self.ab_stages, epi_stages=self.epi_stages, in_stages=self.in_stages,
            raster_along_m=self.raster_along_m, swizzle=self.swizzle,
            operand_dtypes=operand_dtypes, table_periods=table_periods, stage_tables=staged,
            finish_in_gemm=bool(self.program.reductions) and (small if self.finish_in_gemm is None
                                                              else self.finish_in_gemm),
            unroll_subtiles=(unrolled_subtiles(schedule, arch) and not small if self.unroll_subtiles is None
                             else self.unroll_subtiles),
        ).check()
        if staged and self.stage_tables is None and not fits_shared_memory(self.program, config):
            # chosen here, not asked for: where the tables' rings do not fit beside the stages
            # and rings the caller fixed (ab_stages with epi_stages), gather them instead
            config = config.with_(stage_tables=False)
        return config

    def __call__(self, a: torch.Tensor, b: torch.Tensor, /, *, out: dict | None = None,
                 return_partials: bool = False, **operands):
        if type(return_partials) is not bool:
            raise ArgumentError(f"return_partials must be True or False, got {return_partials!r}")
        signature = _signature(a, b, operands, out)
        plan, problem = self._plans.get(signature), None
        if plan is None:
            if isinstance(a, torch.Tensor) and a.is_cuda and torch.cuda.is_current_stream_capturing():
                raise ArgumentError(
                    f"first call of {self.program.name!r} with these shapes/dtypes inside a CUDA graph capture: "
                    "call it once before capturing (the kernel is compiled and loaded on the first call)"
                )
            plan, problem = self.plan(a, b, operands, out)
            self._plans[signature] = plan
        result = plan.run(a, b, operands, out, return_partials, problem)
        if plan.key is not None:
            self.launches += 1
        self.last = plan.launch
        return result

    def plan(self, a: torch.Tensor, b: torch.Tensor, operands: dict, out: dict | None):
        """Check one call completely and remember what every call with the same signature needs:
        (the plan, the bound problem).  The same checks on both paths (module docstring)."""
        problem = bind(self.program, a, b, operands)
        check_outputs(problem, out)
        if not problem.a.is_cuda and not self.strict:
            tile = backend(self.arch or KernelConfig.arch).cta_tile(self.tile or KernelConfig.tile)  # (gpu: in arch)
            return ReferencePlan(self.program, None, None, tile), problem
        check_kernel_arguments(problem, out)
        config = self.config_for(problem)
        if not problem.a.is_cuda:
            lower(self.program, config)  # everything the compile would refuse (UnsupportedError)
            return ReferencePlan(self.program, config, None, backend(config.arch).cta_tile(config.tile)), problem
        config, entry = self.kernel_for(config, problem)
        return CallPlan.build(self.program, problem, config, entry.function, entry.key), problem

    def kernel_for(self, config: KernelConfig, problem: Problem | None = None) -> tuple[KernelConfig, CacheEntry]:
        """(the configuration calls run, its ``cache.CacheEntry``) for ``config`` from ``config_for``,
        compiled for its arch (no GPU needed) or from the cache: with ``autotune`` and the call's
        ``problem`` on the GPU, the fastest candidate there (``cache.get_tuned_kernel``); where this
        Kernel fixes none of tile, cluster, schedule and unroll_subtiles, the rules' choice unless it
        spills or runs latency-bound (``cache.get_default_kernel``); else exactly ``config``, with a
        SpillWarning where it spills."""
        from .cache import get_default_kernel, get_kernel, get_tuned_kernel, spills

        if self.autotune and problem is not None and problem.a.is_cuda:
            tuned = get_tuned_kernel(self.program, config, (problem.m, problem.n, problem.k),
                                     _candidate_timer(self.program, problem))
            return tuned.config, tuned.entry
        if (self.tile, self.cluster, self.schedule, self.unroll_subtiles) == (None, None, None, None):
            default = get_default_kernel(self.program, config)
            return default.config, default.entry
        entry = get_kernel(self.program, config)
        if spills(entry):
            warnings.warn(f"{self.program.name}: the kernel at {config.describe()} spills registers "
                          f"({entry.stack_frame_bytes} bytes of stack frame per thread); with tile, cluster, "
                          "schedule and unroll_subtiles left unset, calls run a configuration that does not spill "
                          "where one exists",
                          SpillWarning, stacklevel=2)
        return config, entry


def _candidate_timer(program: Program, problem: Problem):
    """``time_kernel(config, entry)`` for ``cache.get_tuned_kernel``: ms per call of that kernel on
    ``problem``'s tensors, over TUNE_BATCH calls back to back (as a training step runs them: no
    idle GPU between calls, caches as the last call left them), outputs and partials in fresh
    scratch tensors."""
    plans = {}

    def time_kernel(config: KernelConfig, entry: CacheEntry) -> float:
        plan = plans.get(config)
        if plan is None:
            plan = plans[config] = CallPlan.build(program, problem, config, entry.function, entry.key)
            plan.run(problem.a, problem.b, problem.operands, None, False, problem)  # loads the module
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        plan.run(problem.a, problem.b, problem.operands, None, False, problem)  # the GPU busy when timing starts
        start.record()
        for _ in range(TUNE_BATCH):
            plan.run(problem.a, problem.b, problem.operands, None, False, problem)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / TUNE_BATCH
    return time_kernel


TUNE_BATCH = 5  # calls per timing of a candidate (cache.TUNE_ROUNDS timings each)


@dataclass
class ReferencePlan:
    """A checked call on CPU tensors: the reference interpreter computes it."""

    program: Program
    config: KernelConfig | None
    key: None
    tile: tuple  # the tile whose per-tile partials return_partials gives

    def __post_init__(self):
        self.launch = Launch("reference", self.config, None)  # what Kernel.last says after each call

    def run(self, a, b, operands: dict, out: dict | None, return_partials: bool, problem: Problem | None = None):
        problem = problem or bind(self.program, a, b, operands)
        result = reference.evaluate_problem(problem, tile=self.tile)
        outputs = dict(result.outputs)
        for name, tensor in (out or {}).items():  # written in place, returned as given
            cols = tensor.shape[-1]
            tensor.view(problem.m, cols).copy_(outputs[name].reshape(problem.m, cols))
            outputs[name] = tensor
        return _package(self.program, outputs, result.partials if return_partials else None)


@dataclass
class CallPlan:
    """What every call with one signature (shapes, strides, dtypes, devices, pointer alignment)
    needs, checked and decided once: the warm call path only allocates, launches and finishes."""

    program: Program
    config: KernelConfig
    function: object
    key: str
    m: int
    k: int
    batch_shape: tuple
    device: torch.device
    outputs: list  # (name, cols, dtype)
    partials: list  # (name, shape)
    blocks: int  # arrival counters: the tile rows and tile columns (0 unless finish_in_gemm)
    operands: list  # (name, shape its tensor is viewed as; None: a value, checked every call, op)
    reductions: list  # (name, whether the finished values take the caller's batch shape)

    def __post_init__(self):
        self.launch = Launch("kernel", self.config, self.key)  # what Kernel.last says after each call
        self._scratch: tuple | None = None  # (CUDA stream, partials, arrivals): see scratch

    @classmethod
    def build(cls, program: Program, problem: Problem, config: KernelConfig, function, key) -> "CallPlan":
        """The outputs and partials the kernel's host function takes (``signature``), sized for ``problem``."""
        arguments = host_arguments(program, config)
        m, n, k = problem.m, problem.n, problem.k
        tile = backend(config.arch).cta_tile(config.tile)  # partials come per CTA tile
        outputs = [(arg.of, arg.shape(m, n, k, tile)[1], TORCH_DTYPES[arg.dtype])
                   for arg in arguments if arg.role == "output"]
        partials = [(arg.of, arg.shape(m, n, k, tile)) for arg in arguments if arg.role == "partials"]
        blocks = sum(arg.shape(m, n, k, tile)[0] for arg in arguments if arg.role == "arrivals")
        operands = [(op.name, tuple(problem.operands[op.name].shape) if op.is_tensor else None, op)
                    for op in program.operands]
        reductions = [(o.name, o.axis == "row" and len(problem.batch_shape) != 1) for o in program.reductions]
        return cls(program, config, function, key, problem.m, problem.k, problem.batch_shape, problem.a.device,
                   outputs, partials, blocks, operands, reductions)

    def new_partials(self) -> dict:
        return {name: torch.empty(shape, dtype=torch.float32, device=self.device) for name, shape in self.partials}

    def new_arrivals(self) -> torch.Tensor | None:
        return torch.zeros(self.blocks, dtype=torch.int32, device=self.device) if self.blocks else None

    def scratch(self) -> tuple[dict, torch.Tensor | None]:
        """(partials, arrival counters or None) for a call: the plan's own, made once and reused by
        every call on the CUDA stream that made them (2-3 us of host time less per call, and a
        memset).  Stream order makes that safe: a call's kernels have folded the partials, and set
        the counters back to zero, before the next call's GEMM starts.  Calls on any other stream,
        and calls captured into a CUDA graph (replayed on whichever stream), get fresh ones."""
        if self.device.type != "cuda":
            return self.new_partials(), self.new_arrivals()
        # the raw handle, as Inductor's generated code reads it: torch.cuda.current_stream() costs 4 us
        stream = torch._C._cuda_getCurrentRawStream(self.device.index)
        if torch.cuda.is_current_stream_capturing():
            return self.new_partials(), self.new_arrivals()
        if self._scratch is None:
            self._scratch = (stream, self.new_partials(), self.new_arrivals())
        if self._scratch[0] != stream:
            return self.new_partials(), self.new_arrivals()
        return self._scratch[1], self._scratch[2]

    def run(self, a, b, operands: dict, out: dict | None, return_partials: bool, problem: Problem | None = None):
        # the warm path: everything shape-dependent was decided in build(); reshapes only where
        # the caller passed leading batch dimensions
        args = [a if a.dim() == 2 else a.reshape(self.m, self.k), b]
        results = {}
        for name, cols, dtype in self.outputs:
            if out and name in out:  # checked to flatten in place (check_outputs): written, returned as given
                results[name] = out[name]
                t = out[name] if out[name].dim() == 2 else out[name].view(self.m, cols)
            else:
                t = results[name] = torch.empty(self.m, cols, dtype=dtype, device=self.device)
                if len(self.batch_shape) != 1:
                    results[name] = t.view(*self.batch_shape, cols)
            args.append(t)
        partials, finished = {}, {}
        if self.partials:  # the kernel writes the partials and finishes them
            partials, arrivals = (self.new_partials(), self.new_arrivals()) if return_partials else self.scratch()
            for name, shape in self.partials:
                finished[name] = torch.empty(shape[-1], dtype=torch.float32, device=self.device)
                args += [partials[name], finished[name]]
            if self.blocks:
                args.append(arrivals)
        for name, shape, op in self.operands:
            value = operands[name]
            if shape is None:  # a value, not part of the signature: checked every call
                args.append(check_scalar(op, value))
            else:
                args.append(value if value.shape == shape else value.reshape(shape))
        if self.device.type != "cuda" or self.device.index == torch.cuda.current_device():  # (CPU: test stand-ins)
            self.function(*args)
        else:
            with torch.cuda.device(self.device):
                self.function(*args)
        for name, batched in self.reductions:
            results[name] = finished[name].reshape(self.batch_shape) if batched else finished[name]
        return _package(self.program, results, partials if return_partials else None)


def _tensor_signature(t):
    """What a plan depends on: dtype, device, shape, strides, and whether the data pointer is
    16-byte aligned (so a warm call needs no separate pointer check: a misaligned tensor
    misses the plan and is rejected while planning)."""
    if not isinstance(t, torch.Tensor):
        return type(t)
    return t.dtype, t.device, t.shape, t.stride(), t.data_ptr() % 16 == 0


def _signature(a, b, operands: dict, out: dict | None) -> tuple:
    parts = [_tensor_signature(a), _tensor_signature(b)]
    # operands in the order the call passed them: another order only makes one more plan
    parts += [(name, _tensor_signature(value)) for name, value in operands.items()]
    if isinstance(out, dict):
        parts += [("out", name, _tensor_signature(t)) for name, t in out.items()]
    elif out is not None:
        parts.append(("out", type(out)))
    return tuple(parts)


def _package(program: Program, outputs: dict, partials: dict | None):
    if partials is not None:
        return outputs, partials
    if len(program.outputs) == 1:
        return outputs[program.outputs[0].name]
    return outputs


def device_arch(device: torch.device) -> str:
    """The arch whose kernels a CUDA device runs (its compute capability's backend)."""
    props = torch.cuda.get_device_properties(device)
    for arch, target in BACKENDS.items():
        if (props.major, props.minor) == target.capability:
            return arch
    known = ", ".join(f"{t.arch} ({t.generation})" for t in BACKENDS.values())
    raise UnsupportedError(f"{props.name} is sm_{props.major}{props.minor}; coda-cute kernels target {known}")


def gpu_model(device: torch.device, arch: str = KernelConfig.arch) -> str:
    """Map the CUDA device name to a KernelConfig GPU (the SM count is baked into kernels), for
    kernels of ``arch``: the device must have its backend's compute capability."""
    props = torch.cuda.get_device_properties(device)
    target = backend(arch)
    if device_arch(device) != target.arch:  # (an unknown capability is refused there)
        raise UnsupportedError(f"{props.name} is sm_{props.major}{props.minor}; coda-cute kernels target "
                               f"{target.arch} ({target.generation})")
    models = [model for model in GPUS if GPU_ARCHS[model] == target.arch]
    for needle, model in _GPU_NAMES.items():
        if needle in props.name and model in models and GPUS[model] == props.multi_processor_count:
            return model
    for model in models:
        if GPUS[model] == props.multi_processor_count:
            return model
    raise UnsupportedError(f"{props.name} with {props.multi_processor_count} SMs is not a known "
                           f"{target.generation} GPU")


#: Peak dense 16-bit tensor-core rate (FLOP/s) and memory bandwidth (bytes/s) of an arch's
#: GPUs (H100 SXM, B200), for ``host_bound``
PEAK_RATES = {"sm_90a": (989e12, 3.35e12), "sm_100a": (2250e12, 8.0e12)}
#: A call whose GEMM would take less than this at those rates is host-bound: the host spends
#: 14-20 us on each call (H100 and H200 hosts; benchmarks/results/README.md, "Runtime costs")
HOST_BOUND_S = 10e-6


def host_bound(program: Program, problem: Problem, arch: str) -> bool:
    """Whether ``problem`` is too small to keep the GPU busy: its FLOPs, or the bytes its GEMM
    and epilogue move, would take under ``HOST_BOUND_S`` at the GPU's peak rates.  Such calls
    finish their reductions in the GEMM (``KernelConfig.finish_in_gemm``): one launch less, 4-5
    us of host time, where the GPU would wait for the host anyway; larger calls run the
    finishing kernel, whose tail is 1-2 us shorter on the GPU (results README, "The finish
    folded into the GEMM")."""
    flops_rate, bytes_rate = PEAK_RATES[arch]
    m, n, k = problem.m, problem.n, problem.k
    read = problem.a.nbytes + problem.b.nbytes + sum(
        t.nbytes for t in problem.operands.values() if isinstance(t, torch.Tensor))
    written = sum(m * n * float(out.node.width) * DTYPE_BYTES.get(out.dtype, 2) for out in program.tile_outputs)
    return max(2.0 * m * n * k / flops_rate, (read + written) / bytes_rate) < HOST_BOUND_S


def fill_config(program: Program, m: int, n: int, tile=None, cluster=None, schedule=None,
                arch: str = KernelConfig.arch, sms: int = GPUS[KernelConfig.gpu], k: int | None = None,
                small: bool = False) -> tuple:
    """(tile, cluster, schedule) with what the caller left out (None) filled by the defaults for
    an M x N output of a K-deep product (K None: a large problem's; ``small``: a ``host_bound``
    call's) on a GPU of ``sms`` SMs: a tile alone runs cooperative, a schedule alone gets that
    schedule's default tile, a missing cluster follows the default cluster rule.  An arch whose
    backend has defaults of its own (``Backend.defaults``) fills from those (a cluster:
    ``Backend.default_cluster``).
    `Kernel` fills its configs here, the CLI through ``runtime_defaults``."""
    fixed = backend(arch).defaults if arch in BACKENDS else None
    if fixed is not None:
        tile = tuple(tile or fixed[0])
        return tile, tuple(cluster or backend(arch).default_cluster(tile)), schedule or fixed[2]
    if tile is not None and schedule is None:
        schedule = "cooperative"
    default = default_tile(program, m, n, schedule, sms, k, small)
    return tile or default[0], cluster or default[1], schedule or default[2]


def runtime_defaults(program: Program, tile=None, cluster=None, schedule=None,
                     arch: str = KernelConfig.arch) -> tuple[tuple[int, int], tuple[int, int], str]:
    """Tile, cluster and schedule ``Kernel`` runs for a large problem (M, N in the thousands,
    K = 4096), with the ones given kept and the rest filled as ``Kernel`` fills them: what ``coda-cute emit``,
    ``inspect`` and ``precompile`` build when their flags leave them out.  An arch whose backend
    has defaults of its own (``Backend.defaults``) fills from those."""
    tile, cluster, schedule = fill_config(program, 8192, 8192, tile, cluster, schedule, arch, k=4096)
    return tuple(tile), tuple(cluster), schedule


def default_tile(program: Program, m: int, n: int, schedule: str | None = None, sms: int = GPUS[KernelConfig.gpu],
                 k: int | None = None, small: bool = False) -> tuple[tuple[int, int], tuple[int, int], str]:
    """Tile, cluster and schedule for an M x N output of a K-deep product on a GPU of ``sms``
    SMs: 128x256 with a 2-CTA cluster for big outputs; ping-pong 128x192 for programs with a
    heavy epilogue (see _heavy_epilogue) up to the K of _pingpong_max_k (None: taken as within it),
    or 128x128 where 192-column tiles fill the last wave of tiles so poorly that the smaller
    tile finishes first (_pingpong_tile); cooperative 128x128 for a ``small`` call
    (SMALL_CALL_TILE).  With a ``schedule`` asked for, the tile for that schedule: as above where
    the epilogue is heavy, else 128x128 (every library program compiles there without spills)."""
    # measured on H200 (benchmarks/results, d = 4096): 128x256 with a 1x2 cluster leads for the
    # GEMM and light epilogues; ping-pong 128x192, where one warpgroup's epilogue runs while the
    # other's WGMMAs keep the tensor cores busy, leads where the epilogue is heavy (SwiGLU bwd
    # 1.53 vs 1.72 ms, RoPE 0.67 vs 0.70; RMS + SwiGLU + save 0.863 vs 0.931 at d = 2048) and
    # loses a few % elsewhere (smaller tile; for residual + sumsq and RMSNorm backward, whose
    # epilogues wait on tile inputs).  A deeper K gives each tile's epilogue more mainloop to hide
    # behind, and the wider cooperative tile wins (_pingpong_max_k)
    cluster = (1, 2) if n > 256 else (2, 1) if m > 128 else (1, 1)
    heavy = _heavy_epilogue(program)
    if schedule == "pingpong":
        return (_pingpong_tile(m, n, sms) if heavy else (128, 128)), cluster, "pingpong"
    if small:
        return SMALL_CALL_TILE[0], cluster, SMALL_CALL_TILE[1]
    if n <= 128:
        return (128, 128), cluster, "cooperative"
    if n >= 1024 and heavy and schedule is None and (k is None or k <= _pingpong_max_k(program)):
        return _pingpong_tile(m, n, sms), cluster, "pingpong"
    return (128, 256), cluster, "cooperative"


#: the tile of a call too small to keep the GPU busy (``host_bound``), whose first call waits for
#: the compile and whose GPU time hides behind the host's: cooperative 128x128 gives each thread
#: 64 accumulators where ping-pong 128x128 and cooperative 128x256 give 128, which halves the
#: epilogue's code: a library kernel compiles in 20-40 % less time (median 31 %, development CPU)
#: and, with both warpgroups on each tile, runs in 6-34 % less GPU time (H100; benchmarks/results
#: "Runtime costs", "Small calls run cooperative 128x128")
SMALL_CALL_TILE = ((128, 128), "cooperative")

#: the deepest K at which heavy epilogues default to ping-pong.  Llama MLP and block training
#: steps on an H100 (2026-12-06, benchmarks/results "Llama block"), sustained, with every
#: heavy kernel ping-pong 128x192 against cooperative 128x256: d = K = 2048 3.952 vs 4.004 ms,
#: 4096 13.183 vs 13.212, 8192 52.98 / 53.04 vs 50.79 / 50.85 (block 67.06 vs 64.98)
PINGPONG_MAX_K = 4096

#: the deepest K at which an epilogue heavy only by its stores (more than N columns per row
#: written, no tile read: SwiGLU with its saved pre-activation) defaults to ping-pong.  On an H100
#: (2026-12-07, benchmarks/results "Where the MLP step's time goes"), back to back, gate/up + RMS
#: + SwiGLU + save at ping-pong 128x192 took 0.865 ms against cooperative 128x256's 0.936 at
#: d = K = 2048, but 3.01-3.03 against 2.95 at 4096, and the d = 4096 MLP step ran 1.0-1.4 %
#: faster with it cooperative
PINGPONG_MAX_K_STORES = 2048


def _pingpong_max_k(program) -> float:
    """The deepest K at which a heavy epilogue (_heavy_epilogue) defaults to ping-pong: any for
    exponentials folded into row reductions (their work per element does not shrink against a
    deeper mainloop: cross_entropy_exp_save at 8192 x 128256 x 8192 on an H100, 24.47 ms against
    24.87-24.98 cooperative; benchmarks/results, "The d = 8192 forward keeps ping-pong"),
    PINGPONG_MAX_K_STORES for epilogues heavy only by their stores, else PINGPONG_MAX_K."""
    why = _heavy_because(program)
    if "exponentials" in why:
        return math.inf
    return PINGPONG_MAX_K_STORES if why == {"stores"} else PINGPONG_MAX_K


def _pingpong_tile(m: int, n: int, sms: int) -> tuple[int, int]:
    """128x192, unless 128x128 tiles take clearly less time by a count of waves: a persistent
    kernel's time goes as (tiles per SM, rounded up) x (a tile's area).  On an H100 at M = 8192,
    N = K = 2048 the 704 tiles of 128x192 make 5.33 waves, run as 6, and SwiGLU's backward ran
    1.18x our GEMM there against 1.00x with 128x128 (8 waves of 1024 tiles); at N = 8192 and
    16384 the two tie by this count and 128x192 stays (measured faster on the H200)."""
    def cost(rows: int, cols: int) -> int:
        tiles = math.ceil(m / rows) * math.ceil(n / cols)
        return math.ceil(tiles / sms) * rows * cols  # whole waves x a tile's area
    return (128, 128) if cost(128, 128) < 0.95 * cost(128, 192) else (128, 192)


def _heavy_epilogue(program) -> bool:
    """Whether the epilogue is heavy for any of _heavy_because's reasons and has no segment
    reductions (whose segments, e.g. 128-column heads, need not divide 192 columns)."""
    return bool(_heavy_because(program)) and not program.uses("segreduce")


def _heavy_because(program) -> set[str]:
    """Why the epilogue is heavy: "wide", it reads or writes 2N-wide tiles (SwiGLU backward);
    "tables", it reads tables (RoPE); "stores", it writes more than N columns per row without
    reading tile inputs (SwiGLU with its saved pre-activation: N/2 + N); "exponentials", it folds
    exponentials of each row into a row reduction (cross-entropy's statistics: a log-sum-exp, two
    exponentials per element, or a sum of the stored exponentials; cross_entropy_exp_save at
    8192 x 128256 x 4096 on an H100: ping-pong 128x192 11.97 ms, cooperative 128x256 13.21,
    benchmarks/results "Stored exponentials instead of stored logits")."""
    tile_inputs = any(op.kind == "tile" for op in program.operands)
    row_reductions = [out for out in program.reductions if out.axis == "row"]
    reasons = {
        "wide": any(op.kind == "tile" and op.width == 2 for op in program.operands)
        or any(out.node.width == 2 for out in program.tile_outputs),
        "tables": any(op.kind == "table" for op in program.operands),
        "stores": not tile_inputs and sum(out.node.width for out in program.tile_outputs) > 1,
        "exponentials": any(out.reduce == "logsumexp" for out in row_reductions)
        or (program.uses("exp") and bool(row_reductions)),
    }
    return {reason for reason, holds in reasons.items() if holds}


# ----------------------------------------------------------------------------- checks
def _check_settings(tile, cluster, schedule, gpu, ab_stages, epi_stages, in_stages, raster_along_m, swizzle,
                    arch=None) -> None:
    """Refuse a Kernel setting no call could build, when the Kernel is made (not at its first
    call, and on the CPU as on the GPU): the fields given are checked as a KernelConfig would."""
    if arch is not None and arch not in DEFAULT_GPUS:
        raise UnsupportedError(f"arch {arch!r} is not supported; supported: {', '.join(DEFAULT_GPUS)}")
    if gpu is not None and gpu not in GPUS:
        raise UnsupportedError(f"GPU {gpu!r} is unknown; known: {', '.join(GPUS)}")
    arch = arch or (GPU_ARCHS[gpu] if gpu is not None else KernelConfig.arch)
    probe_tile = tile if tile is not None else (128, 128)
    KernelConfig(arch=arch, tile=probe_tile, cluster=cluster if cluster is not None else (1, 1),
                 schedule=schedule if schedule is not None else "cooperative",
                 gpu=gpu if gpu is not None else DEFAULT_GPUS[arch], ab_stages=ab_stages, epi_stages=epi_stages,
                 in_stages=in_stages, raster_along_m=raster_along_m, swizzle=swizzle).check()


def stageable_tables(program: Program, problem: Problem, tile_m: int) -> str | None:
    """None if TMA can bring every table operand of this call into smem in subtile slices
    (KernelConfig.stage_tables), else why not, naming the table: its rows R must be a multiple
    of the tile's rows (a tile's rows never wrap), its period P a multiple of 32 columns (whole
    subtile slices), its rows and data 16-byte aligned, and no segment reduction may read it
    (those run over their segments before the segments' slices arrive)."""
    in_segments = tables_in_segment_reductions(program)
    for op in (op for op in program.operands if op.kind == "table"):
        table = problem.operands[op.name]
        rows, period = table.shape
        if op.name in in_segments:
            return f"table {op.name!r} is read by a segment reduction, which cannot read a table staged in smem"
        if rows % tile_m or period % 32:
            return (f"table {op.name!r} is ({rows}, {period}); staged in smem it needs rows that are a multiple "
                    f"of the tile's {tile_m} and a period that is a multiple of 32")
        if not _row_stride_ok(table) or not _aligned(table):
            return (f"table {op.name!r} (strides {table.stride()}): staged in smem it needs unit column stride, "
                    "16-byte aligned rows and a 16-byte aligned data pointer")
    return None


_KERNELS: dict = {}
_LOCK = threading.Lock()


def run(program: Program, a: torch.Tensor, b: torch.Tensor, /, **kwargs):
    """Run ``program`` on ``acc = a @ b.T`` with the default configuration."""
    if not isinstance(program, Program):
        raise ProgramError(f"run needs a coda_cute Program (@coda_cute.epilogue), got {type(program).__name__}")
    with _LOCK:
        kernel = _KERNELS.get(program.fingerprint)
        if kernel is None:
            kernel = _KERNELS[program.fingerprint] = Kernel(program)
    return kernel(a, b, **kwargs)

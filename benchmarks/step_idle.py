"""Is a training step host-bound, or idle between its kernels?  Per contender of bench_block's
cases (coda-cute and the floor): the host's time to queue one step (alone, and among steps queued
back to back), the GPU's time per step back to back (CUDA events), and in a profiled window of
five queued steps the kernels' summed time, the time at least one kernel ran (kernels that
overlap, such as a dependent launch waiting for the kernel before it, count once) and the
window's span (span less that time: the GPU idle between kernels), per step.  With ``--energy S``
also the energy of a step: the steps run back to back for S seconds while nvidia-smi samples the
SM clock and board power (`clocks.sample`), and mJ per step is the median power times the time
per step.  At the board's power cap a step's time follows its energy, so this says whether our
step is slower than the floor because it does more work per step or because it waits.

    python benchmarks/step_idle.py --d 2048 [--cases block MLP] [--energy 3]

Prints one JSON line per (case, contender).  Needs a GPU."""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_block as bb  # noqa: E402  (the cases and contenders bench_block times)

CASES = {"block": bb.block_case, "MLP": bb.mlp_case}
QUEUED, PROFILED = 30, 5  # steps queued back to back; steps in the profiled window


def energy(contender, seconds: float) -> dict:
    """The step's SM clock, board power and energy while steps run back to back for `seconds`."""
    from clocks import sample  # nvidia-smi's samples (imports bench_sm90: only when asked for)
    got = sample(contender, seconds)
    return dict(sm_mhz=got["sm_mhz"], power_w=got["power_w"], throttle_reasons=got["throttle_reasons"],
                sampled_ms_per_step=round(got["ms_per_call"], 3), mj_per_step=round(got["power_w"] * got["ms_per_call"], 1))


def measure(contender) -> dict:
    for _ in range(5):
        contender()
    host = []
    for _ in range(5):  # the host's time for one step with an empty queue
        torch.cuda.synchronize()
        start = time.perf_counter()
        contender()
        host.append((time.perf_counter() - start) * 1e3)
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start = time.perf_counter()
    begin.record()
    for _ in range(QUEUED):
        contender()
    end.record()
    queued = (time.perf_counter() - start) * 1e3 / QUEUED
    end.synchronize()

    def window():
        for _ in range(PROFILED):
            contender()

    events = bb.gpu_work(window)
    intervals = [(e.time_range.start, e.time_range.end) for e in events]  # us
    busy = sum(last - first for first, last in intervals) / 1e3
    span = (max(last for _, last in intervals) - min(first for first, _ in intervals)) / 1e3
    covered = covered_us(intervals) / 1e3
    return dict(host_ms_alone=round(statistics.median(host), 3), host_ms_queued=round(queued, 3),
                gpu_ms_back_to_back=round(begin.elapsed_time(end) / QUEUED, 3),
                profiled_busy_ms=round(busy / PROFILED, 3), profiled_covered_ms=round(covered / PROFILED, 3),
                profiled_span_ms=round(span / PROFILED, 3),
                profiled_idle_ms=round((span - covered) / PROFILED, 3), kernels_per_step=len(events) // PROFILED)


def covered_us(intervals) -> float:
    """The time at least one of the (start, end) intervals covers: overlapping kernels count once."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d", type=int, nargs="+", default=[2048], choices=sorted(bb.SHAPES))
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--energy", type=float, default=0, metavar="SECONDS",
                        help="also sample clock and power for this long per contender: mJ per step")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a GPU")
    bench = bb.Bench(argparse.Namespace(smoke=False, tokens=args.tokens, seq=args.seq, compile_modes=[],
                                        vocab=0))
    for d in args.d:
        bench.inputs(d)
        for case_name in args.cases:
            case = CASES[case_name](bench, d)
            for who in (bb.CODA, bb.FLOOR):
                row = dict(d=d, case=case_name, who=who, **measure(case.contenders[who]))
                if args.energy:
                    row.update(energy(case.contenders[who], args.energy))
                print(json.dumps(row), flush=True)
            del case
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

"""Where do we stand now?  The newest result of each kind, as tables, in benchmarks/RESULTS.md.

    python benchmarks/report.py [RESULT.json ...] [-o benchmarks/RESULTS.md]

Reads result files in the formats the benchmark scripts write:

- bench_sm90.py: ``{"meta", "rows"}``, a row per op with ``"op"`` and one entry per contender
  (``{"ms", "spread"}``): each fused op against our own GEMM, cuBLAS, eager and torch.compile;
- bench_block.py: ``{"meta", "rows"}``, a row per case with ``"what"`` (the Llama MLP, block and
  LM head); a contender may also carry ``b2b_ms``, ``gpu_ms`` and ``peak_gib`` (shown) and other keys, such
  as per-kernel lists (ignored);
- bench_runtime.py: ``{"meta", "kernels", "host_overhead_us"}``: compile, warm-load and per-call
  costs.

For each d (2048, 4096, 8192) it writes the ops tables, then the block tables, each under its
file's date, GPU, commit and command; then the runtime costs.  With no files named it reads
INPUTS below, the newest archived run of each kind for each d: when a newer run is archived,
put it in and run this again.  Files are taken in order, newest first: an op or case already
shown at a d is left out of later files (an op only when it has the same contenders, so a run
with more torch.compile modes or peers still shows).  A file that is missing or unreadable is
listed as such.
The tables' meaning and the decisions taken from them: benchmarks/results/README.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

#: the newest archived run of each kind for each d, newest first (paths relative to benchmarks/);
#: an entry may be (path, note), the note printed under that file's tables' heading
INPUTS = [
    ("results/archive/2026-12-07h-h100-d4096-lm-68b8fde.json",
     "On an H100 80GB HBM3, 7 rounds; the forward's cross_entropy_stats_save runs ping-pong 128x192 (4861728). "
     "Two more runs of that day: wall 37.870 vs torch.compile 38.888 (4861728), 39.584 vs 39.912 (68b8fde)."),
    ("results/archive/2026-12-06i-h100-programs-8192x4096x4096-6104ba4.json",
     "On an H100 80GB HBM3, after bd87b29 (division and square root without IEEE slow paths) and 2fbec7c "
     "(autotune timed in rounds); ping-pong kernels ran the subtile loop from the IR (undone in 6bcd476)."),
    ("results/archive/2026-12-06i-h100-programs-8192x2048x2048-6104ba4.json",
     "On an H100 80GB HBM3, after bd87b29 and 2fbec7c; ping-pong kernels as above."),
    ("results/archive/2026-12-06j-h100-d8192-mlp-block-70ca0fe.json",
     "On an H100 80GB HBM3: GPU times of a step profiled after 150 ms of steps (2a5a196). 5 rounds; the "
     "block's coda-cute wall times spread 12 %."),
    ("results/archive/2026-12-06j-h100-d2048-mlp-block-70ca0fe.json",
     "On an H100 80GB HBM3: GPU times of a step profiled after 150 ms of steps (2a5a196). 5 rounds."),
    ("results/archive/2026-12-07m-h100-d2048-mlp-e387741.json",
     "On an H100 80GB HBM3: the large-call kernels of 2026-12-06's runs, 3 rounds; Liger-Kernel was not installed."),
    ("results/archive/2026-12-07n-h100-runtime-04ecde3.json",
     "On an H100 80GB HBM3 (our GEMM compiled in 0.60 s), every library program, at 04ecde3 (no kernel change "
     "since e387741)."),
    ("results/archive/2026-12-07l-h100-runtime-e387741.json",
     "On an H100 80GB HBM3 (our GEMM compiled in 0.59 s), every library program: small calls run cooperative "
     "128x128 (62205e1). The same host's run before it: `archive/2026-12-07k-h100-runtime-e387741.json`."),
    ("results/archive/2026-12-07i-h100-runtime-e49c270.json",
     "On an H100 80GB HBM3 (our GEMM compiled in 0.95 s), the ping-pong programs and the GEMM only: small calls' "
     "ping-pong kernels loop over their subtiles in the IR (e49c270)."),
    ("results/archive/2026-12-07-h100-runtime-e30f68b.json",
     "On an H100 80GB HBM3 whose host compiles 1.6x slower than e9691e1's (our GEMM 1.23 vs 0.77 s): tiny calls "
     "finish their reductions in the GEMM (4215d1b), so their kernels are the ones compiled and timed."),
    ("results/archive/2026-12-06j-h100-runtime-5eea87e.json",
     "On an H100 80GB HBM3 whose host compiles 1.77x slower than e9691e1's (our GEMM 1.36 vs 0.77 s) and whose "
     "per-call timings were disturbed in this run (cuBLAS 21.1 us per call; 14.0 in three runs right after: "
     "residual_sumsq 21.2 vs 14.0, `archive/2026-12-06j-h100-runtime-host-5eea87e.json`)."),
    ("results/archive/2026-12-06i-h100-runtime-e9691e1.json",
     "On an H100 80GB HBM3 whose host compiles 1.47x faster than 59000c0's (our GEMM 0.77 vs 1.13 s): after "
     "6104ba4 (cooperative kernels' subtile loop in the IR)."),
    ("results/archive/2026-12-06h-h100-d8192-mlp-block-59000c0.json",
     "On an H100 80GB HBM3: the SwiGLU backward + h at ping-pong 128x192 again (fa68938). 3 rounds. GPU times are "
     "of one step profiled after the memory measurements left the GPU idle (bench_block profiles after 150 ms of "
     "steps since 2a5a196)."),
    ("results/archive/2026-12-06g-h100-d8192-mlp-7527889.json",
     "On an H100 80GB HBM3: after 541d5e8 (heavy epilogues cooperative beyond K = 4096) and 809a1cb (the "
     "normalized input made before the weight gradient). 3 rounds."),
    ("results/archive/2026-12-06g-h100-d2048-mlp-7527889.json",
     "On an H100 80GB HBM3: after 809a1cb (the normalized input made before the weight gradient). 3 rounds."),
    ("results/archive/2026-12-06f-h100-d8192-mlp-block-13ee467.json",
     "On an H100 80GB HBM3 (no H200 was lent that day): compare within this table only. 5 rounds; the block's "
     "coda-cute wall times spread 14.6 %."),
    ("results/archive/2026-12-06f-h100-d2048-block-13ee467.json",
     "On an H100 80GB HBM3: after 13ee467 (the q/k/v gradient pass on 32-bit words). 5 rounds."),
    ("results/archive/2026-12-06f-h100-d4096-block-13ee467.json",
     "On an H100 80GB HBM3: after 13ee467 (the q/k/v gradient pass on 32-bit words). 5 rounds. The floor's "
     "GPU time (15.82 ms) is 0.76 ms above its 3b6edf3 run's on another H100: its cuBLAS GEMMs took 14.44 ms, not 13.75."),
    ("results/archive/2026-12-06f-h100-d2048-mlp-block-5e5851b.json",
     "On an H100 80GB HBM3, before 13ee467. 5 rounds."),
    ("results/archive/2026-12-06e-h100-d2048-d4096-mlp-7d0b786.json",
     "On an H100 80GB HBM3 (no H200 was lent that day): compare within this table only. 5 rounds. Another "
     "H100's run of the same MLP kernels (321ca57, `archive/2026-12-06e-h100-d4096-LM-MLP-321ca57.json`) gave coda-cute 11.20 GPU ms at d = 4096, not 12.94."),
    ("results/archive/2026-12-06e-h100-d2048-block-3b6edf3.json",
     "On an H100 80GB HBM3 (no H200 was lent that day): compare within this table only. 5 rounds."),
    ("results/archive/2026-12-06e-h100-d4096-block-3b6edf3.json",
     "On an H100 80GB HBM3 (no H200 was lent that day): compare within this table only. 5 rounds."),
    ("results/archive/2026-12-06e-h100-d4096-LM-3b6edf3.json",
     "On an H100 80GB HBM3 (no H200 was lent that day): compare within this table only. 5 rounds."),
    ("results/archive/2026-12-06e-h100-programs-hand-derived-7d0b786.json",
     "On an H100 80GB HBM3: hand-written backward programs beside the derived ones, one process."),
    ("results/archive/2026-12-06e-h100-programs-derived-8192x4096x4096-3b6edf3.json",
     "On an H100 80GB HBM3: the backwards `cc.derive` makes of five library forward programs."),
    ("results/archive/2026-12-06e-h100-programs-derived-8192x2048x2048-3b6edf3.json",
     "On an H100 80GB HBM3, before 0405c6e (ping-pong 128x128 where 128x192 fills its last wave poorly, "
     "which is the config autotune chose for swiglu_backward and rms_swiglu_save_backward here)."),
    ("results/archive/2026-12-06d-h100-d4096-block-71eea5d.json",
     "On an H100 80GB HBM3 (no H200 was lent that day): compare within this table only. 3 rounds of "
     "300 ms timed after 150 ms of steps; wall times spread 0.8-3 %."),
    ("results/archive/2026-12-06d-h100-d4096-mlp-71eea5d.json",
     "On an H100 80GB HBM3 (no H200 was lent that day): compare within this table only. 3 rounds of "
     "300 ms timed after 150 ms of steps; wall times spread 0.7-8 %."),
    ("results/archive/2026-12-06c-h100-d4096-block-4492b3a.json",
     "On an H100 80GB HBM3 (no H200 was lent that day): compare within this table only. 3 repetitions; "
     "wall times spread 2-8 % (the floor's 16-21 %)."),
    ("results/archive/2026-12-06c-h100-d2048-block-4492b3a.json",
     "On an H100 80GB HBM3 (no H200 was lent that day): compare within this table only. 3 repetitions; "
     "wall times spread 1-11 %."),
    ("results/archive/2026-12-06b-h100-d4096-mlp-62245be.json",
     "On an H100 80GB HBM3 (no H200 was lent that day): compare within this table only. 3 repetitions."),
    ("results/archive/2026-12-06-h100-d4096-block-a2167ed.json",
     "On an H100 80GB HBM3 (no H200 was lent that day): compare within this table only. 3 repetitions; "
     "the MLP's wall times spread 17-19 % (its GPU times are the steadier measure), the block's 0.4-13 %."),
    "results/archive/2026-12-04d-h200-d2048-ops-b3b00bf.json",
    "results/archive/2026-12-04d-h200-d4096-ops-b3b00bf.json",
    "results/archive/2026-12-04d-h200-d4096-ops-modes-quack-b3b00bf.json",
    "results/archive/2026-12-04d-h200-d8192-ops-b3b00bf.json",
    "results/archive/2026-12-04d-h200-d4096-block-b3b00bf.json",
    "results/archive/2026-12-04d-h200-d2048-d8192-block-b3b00bf.json",
    "results/archive/2026-12-04c-h200-d2048-block-ea59bc7.json",  # the LM head at d = 2048
    ("results/archive/2026-12-03c-h200-d2048-d8192-block-LM-a87b558.json",  # the LM head at d = 8192
     "In this run \"coda-cute\" recomputes the logits in backward (`save_logits=False` now); "
     "\"coda-cute, saved logits\" is the current default."),
    "results/archive/2026-12-03-h200-runtime-d18d7a1.json",
]
OUT = HERE / "RESULTS.md"

# bench_sm90 contenders shown first, in this order; the rest follow as they come
OPS_FIRST = ("coda-cute", "coda-cute GEMM alone", "cuBLAS GEMM alone", "torch eager")
CONFIG_PREFIX_END = "majors "  # "sm_90a H200 (132 SMs), bf16 inputs, majors kk, tile ..." -> "tile ..."


def load(path: Path) -> tuple[str, dict | None, str]:
    """(kind, data, problem): kind is ops, block, programs, runtime or unknown; problem says why data is None."""
    if not path.exists():
        return "missing", None, "missing"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        return "unreadable", None, f"unreadable ({type(exc).__name__}: {exc})"
    if not isinstance(data, dict):
        return "unknown", None, "not a result file (no top-level object)"
    if "kernels" in data or "host_overhead_us" in data:
        return "runtime", data, ""
    rows = data.get("rows")
    if isinstance(rows, list) and rows and all(isinstance(r, dict) for r in rows):
        if all("op" in r and contenders(r) for r in rows):
            return "ops", data, ""
        if all("program" in r and "shape" in r and contenders(r) for r in rows):
            return "programs", data, ""
        if all(("what" in r or "case" in r) and contenders(r) for r in rows):
            return "block", data, ""
    return "unknown", None, "a format report.py does not render"


def meta(data: dict) -> dict:
    found = data.get("meta")
    if isinstance(found, dict):
        return found
    return {k: data[k] for k in ("date", "gpu", "commit", "command") if k in data}


def contenders(row: dict) -> list[str]:
    """The row's keys whose value is a timing ({"ms": ...}), in order."""
    return [k for k, v in row.items() if isinstance(v, dict) and isinstance(v.get("ms"), (int, float))]


def ms(value: float) -> str:
    return f"{value:.3f}" if value < 100 else f"{value:.1f}"


def pct(value) -> str:
    return f"{100 * value:.0f} %" if isinstance(value, (int, float)) else "-"


def ratio(a: dict | None, b: dict | None) -> str:
    return f"{a['ms'] / b['ms']:.3f}" if a and b and b["ms"] else "-"


def compile_key(keys) -> str | None:
    """torch.compile's default mode where present, else the first torch.compile contender."""
    for k in ("torch.compile default", "torch.compile"):
        if k in keys:
            return k
    return next((k for k in keys if k.startswith("torch.compile")), None)


def source_line(path: Path, data: dict) -> str:
    m = meta(data)
    versions = ", ".join(f"{k} {m[k]}" for k in ("torch", "cutlass_dsl") if k in m)
    head = ", ".join(str(m[k]) for k in ("date", "gpu") if k in m) or "no date or GPU recorded"
    head += f", commit {m.get('commit', 'unknown')}" + (f" ({versions})" if versions else "")
    command = f"`{m['command']}`" if "command" in m else "command not recorded"
    return f"{head}; {command}; file `{display(path)}`."


def display(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(HERE.parent))
    except ValueError:
        return str(path)


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell.replace("|", "/") for cell in row) + " |" for row in rows]
    return lines


def ops_table(rows: list[dict]) -> list[str]:
    """One line per op: our time and the floor ratios, then every contender's ms."""
    names: list[str] = [k for k in OPS_FIRST if any(k in r for r in rows)]
    for r in rows:
        names += [k for k in contenders(r) if k not in names]
    compiled = compile_key(names)
    header = ["op", "x our GEMM", "x cuBLAS"] + ([f"{compiled} / ours"] if compiled else [])
    header += [f"{n}, ms" for n in names] + ["spread of ours", "config"]
    out = []
    for r in rows:
        ours = r.get("coda-cute")
        line = [str(r["op"]), ratio(ours, r.get("coda-cute GEMM alone")), ratio(ours, r.get("cuBLAS GEMM alone"))]
        if compiled:
            line.append(f"{r[compiled]['ms'] / ours['ms']:.2f}" if ours and compiled in r else "-")
        line += [ms(r[n]["ms"]) if n in r else "-" for n in names]
        config = str(r.get("config", "-"))
        if CONFIG_PREFIX_END in config:  # the arch, GPU, dtype and majors are the same on every row
            config = config.split(CONFIG_PREFIX_END, 1)[1].split(", ", 1)[-1]
        line += [pct(ours.get("spread")) if ours else "-", config]
        out.append(line)
    return table(header, out)


def block_table(rows: list[dict]) -> list[str]:
    """One line per case and contender: ms, spread, over torch.compile, and back-to-back ms / GPU ms /
    peak GiB when given."""
    every = [r[k] for r in rows for k in contenders(r)]
    shown = (("b2b_ms", "back-to-back ms"), ("gpu_ms", "GPU ms"), ("peak_gib", "peak GiB"))
    extra = [(key, label) for key, label in shown if any(key in c for c in every)]
    header = ["case", "contender", "ms", "spread", "x torch.compile"] + [label for _, label in extra]
    out = []
    for r in rows:
        names = contenders(r)
        compiled = compile_key(names)
        for n in names:
            c = r[n]
            line = [str(r.get("what") or r.get("case")), n, ms(c["ms"]), pct(c.get("spread")),
                    ratio(c, r.get(compiled)) if compiled else "-"]
            line += [(ms(c[key]) if key.endswith("_ms") else f"{c[key]:.1f}")
                     if isinstance(c.get(key), (int, float)) else "-" for key, _ in extra]
            out.append(line)
    return table(header, out)


def programs_table(rows: list[dict]) -> list[str]:
    """bench_programs: one line per program and shape, fused and autotuned over our GEMM at the
    fused kernel's configuration, torch.compile of the unfused math over the faster of ours."""
    header = ["program", "kind", "shape", "x our GEMM", "autotune x our GEMM", "torch.compile / ours",
              "default config", "autotune's config"]
    out = []
    for r in rows:
        fused, tuned, gemm, compiled = (r.get(k) for k in ("fused", "fused autotune", "GEMM", "torch.compile"))
        best = min((c for c in (fused, tuned) if c), key=lambda c: c["ms"], default=None)
        out.append([str(r["program"]), str(r.get("kind", "-")), str(r["shape"]), ratio(fused, gemm),
                    ratio(tuned, gemm), ratio(compiled, best),
                    str(r.get("config", "-")), str(r.get("autotune_config", "-"))])
    return table(header, out)


def runtime_tables(data: dict) -> list[str]:
    lines = []
    kernels = [k for k in data.get("kernels", []) if isinstance(k, dict)]
    if kernels:
        # tvm_ffi's import is a phase of its own since bench_runtime timed it apart (older files: "-")
        phases = ("import_ms", "library_ms", "key_ms", "tvm_ffi_ms", "load_ms")
        header = ["program", "cold compile s", "first call s", "warm load ms", "after imports ms",
                  "import / library / key / tvm_ffi / load ms", "GC before, ms"]
        rows = []
        for k in kernels:
            split = " / ".join(str(k.get(p, "-")) for p in phases) if "warm_load_ms" in k else "-"
            rows.append([str(k.get("program", "?")), str(k.get("compile_s", "-")), str(k.get("first_call_s", "-")),
                         str(k.get("warm_load_ms", "-")), str(k.get("warm_load_after_imports_ms", "-")), split,
                         str(k.get("gc_before_ms", "-"))])
        lines += table(header, rows) + [""]
    overhead = data.get("host_overhead_us")
    if isinstance(overhead, dict) and overhead:
        cols = ["coda-cute host", "cuBLAS host", "coda-cute throughput", "cuBLAS throughput"]
        rows = [[label] + [str(v.get(c, "-")) for c in cols] for label, v in overhead.items() if isinstance(v, dict)]
        lines += ["Per call on a 128x128x128 problem, us (host: CPU time issuing the calls; throughput: "
                  "to the last kernel's end):", ""]
        lines += table(["program"] + cols, rows) + [""]
    return lines


def first_seen(files: list[tuple[Path, dict]], kind: str) -> list[tuple[Path, dict]]:
    """The files with the rows that no earlier file had (the same d and op or case; for ops, also
    the same contenders); files left with no rows are dropped."""
    seen, out = set(), []
    for path, data in files:
        rows = []
        for r in data["rows"]:
            key = (r.get("d"), r.get("op") or r.get("what") or r.get("case"))
            key += tuple(contenders(r)) if kind == "ops" else ()
            if key not in seen:
                seen.add(key)
                rows.append(r)
        if rows:
            out.append((path, {**data, "rows": rows}))
    return out


def by_d(rows: list[dict]) -> dict:
    out: dict = {}
    for r in rows:
        out.setdefault(r.get("d", "?"), []).append(r)
    return out


def summary(ops: list[tuple[Path, dict]]) -> list[str]:
    """Fused op / our GEMM (plain GEMMs: / cuBLAS) per d, from each d's first ops file, and torch.compile / ours."""
    first: dict = {}
    for _, data in ops:
        for d, rows in by_d(data["rows"]).items():
            first.setdefault(d, rows)
    if not first:
        return []
    ds = sorted(first, key=str)
    names: list[str] = []
    for d in ds:
        names += [r["op"] for r in first[d] if r["op"] not in names]
    header = ["op"] + [f"d = {d}" for d in ds] + ["torch.compile / ours (" + " / ".join(map(str, ds)) + ")"]
    rows = []
    for name in names:
        cells, compiled = [], []
        for d in ds:
            r = next((r for r in first[d] if r["op"] == name), None)
            if r is None:
                cells.append("-")
                compiled.append("-")
                continue
            floor = "coda-cute GEMM alone" if "coda-cute GEMM alone" in r else "cuBLAS GEMM alone"
            cell = ratio(r.get("coda-cute"), r.get(floor))
            cells.append(cell if floor == "coda-cute GEMM alone" or cell == "-" else f"{cell} x cuBLAS")
            key = compile_key(contenders(r))
            compiled.append(f"{r[key]['ms'] / r['coda-cute']['ms']:.2f}" if key and "coda-cute" in r else "-")
        rows.append([name] + cells + [" / ".join(compiled)])
    return table(header, rows)


def report(paths: list[Path], notes: dict | None = None) -> tuple[str, list[str]]:
    """The Markdown text, and the problems found (missing or unreadable files).  ``notes``: a
    line to print under a file's heading, by path."""
    notes = notes or {}
    loaded = [(p, *load(p)) for p in paths]
    problems = [f"{display(p)}: {why}" for p, kind, data, why in loaded if data is None]
    ops = first_seen([(p, data) for p, kind, data, _ in loaded if kind == "ops"], "ops")
    blocks = first_seen([(p, data) for p, kind, data, _ in loaded if kind == "block"], "block")
    programs = [(p, data) for p, kind, data, _ in loaded if kind == "programs"]
    runtimes = [(p, data) for p, kind, data, _ in loaded if kind == "runtime"]
    lines = ["# Current results", "",
             "Generated by `python benchmarks/report.py` from the result files listed below (edit its `INPUTS`",
             "or name files on its command line; do not edit this file by hand). What the numbers mean and",
             "what was decided from them: [`results/README.md`](results/README.md). Times are medians over",
             "interleaved repetitions, spread = (max - min) / median; \"x our GEMM\" is a fused op's time over",
             "our plain GEMM on the same operands, \"x cuBLAS\" over cuBLAS's GEMM alone.", "",
             "Every number here is from a Hopper GPU (sm_90a kernels). The sm_100a (Blackwell) kernels are",
             "compile-verified only: built and their SASS checked without a Blackwell GPU, never run or timed.",
             "", "Inputs:", ""]
    for p, kind, data, why in loaded:
        lines.append(f"- `{display(p)}`: " + (kind if data is not None else f"**{why}**"))
    lines.append("")
    if ops:
        lines += ["## Summary", "",
                  "Fused ops as a multiple of our GEMM (plain GEMMs: of cuBLAS), and torch.compile's time over ours,",
                  "from each d's first ops file below.", ""] + summary(ops) + [""]
    ds = sorted({d for _, data in ops + blocks for d in by_d(data["rows"])}, key=str)
    for d in ds:
        lines += [f"## d = {d}", ""]
        for title, group, render in (("Fused ops and GEMMs", ops, ops_table),
                                     ("Llama MLP, block and LM head, forward + backward", blocks, block_table)):
            for p, data in group:
                rows = by_d(data["rows"]).get(d)
                if rows:
                    note = [notes[p], ""] if p in notes else []
                    lines += [f"### {title}", "", source_line(p, data), ""] + note + render(rows) + [""]
    if programs:
        lines += ["## Programs nobody tuned (bench_programs)", ""]
    for p, data in programs:
        note = [notes[p], ""] if p in notes else []
        lines += [source_line(p, data), ""] + note + programs_table(data["rows"]) + [""]
    for p, data in runtimes:
        lines += ["## Runtime costs", "", source_line(p, data), ""] + runtime_tables(data)
    return "\n".join(lines).rstrip() + "\n", problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="*", type=Path, help=f"result JSON files (default: INPUTS, {len(INPUTS)} files)")
    parser.add_argument("-o", "--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    entries = [(e, None) if isinstance(e, str) else e for e in INPUTS]
    paths = args.results or [HERE / p for p, _ in entries]
    notes = {} if args.results else {HERE / p: note for p, note in entries if note}
    text, problems = report(paths, notes)
    args.out.write_text(text)
    for problem in problems:
        print(f"report.py: {problem}", file=sys.stderr)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

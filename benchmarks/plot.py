"""How do the contenders of one run compare, at a glance?  A bar chart of a result file
(bench_sm90.py or bench_block.py JSON) as a PNG; the tables are report.py's.

    python benchmarks/plot.py benchmarks/results/archive/<run>.json [-o chart.png]

One group of bars per op (or block case), one bar per contender: time relative to the
row's "cuBLAS GEMM alone" where the row has it (else ms), lower is better, with the spread
over the repetitions as an error bar.  Needs matplotlib (`pip install
'coda-cute[bench]'`).
"""

import argparse
import json
import textwrap
from pathlib import Path


def contenders(rows: list[dict]) -> list[str]:
    names: list[str] = []
    for row in rows:
        names += [k for k, v in row.items() if isinstance(v, dict) and "ms" in v and k not in names]
    return names


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("result", type=Path)
    parser.add_argument("-o", "--out", type=Path)
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(args.result.read_text())
    rows, meta = data["rows"], data["meta"]
    names = contenders(rows)
    labels = [textwrap.fill(f"{r.get('op') or r.get('what')} (d={r['d']})", 16) for r in rows]
    relative = all("cuBLAS GEMM alone" in r for r in rows)
    base = [r["cuBLAS GEMM alone"]["ms"] if relative else 1.0 for r in rows]
    width = 0.8 / len(names)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(rows)), 4.5))
    for i, name in enumerate(names):
        xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(rows))]
        ms = [r[name]["ms"] / b if name in r else 0.0 for r, b in zip(rows, base)]
        err = [r[name]["ms"] / b * r[name].get("spread", 0.0) / 2 if name in r else 0.0 for r, b in zip(rows, base)]
        ax.bar(xs, ms, width, yerr=err, label=name, capsize=2)
    ax.set_xticks(range(len(rows)), labels, fontsize=8)
    ax.set_ylabel("time / cuBLAS GEMM alone" if relative else "ms (lower is better)")
    ax.set_title(f"{meta['gpu']}, {meta['date']}, commit {meta['commit']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = args.out or args.result.with_suffix(".png")
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

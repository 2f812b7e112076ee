"""Where do the warps stall, per kernel and per SASS instruction?  Read from Nsight Compute's
source page; the second half of profile_op.py's question.

    ncu -i report.ncu-rep --page source --print-source sass --csv > sass.csv
    python benchmarks/ncu_stalls.py sass.csv [--top 12] [--kernel 0 --from ADDR --to ADDR]

For each kernel in the CSV: the stall reasons over all PC samples, then the instructions with
the most samples and their top reasons.  With --kernel and an address range (hex, as the CSV
prints them), every instruction of that range with its samples and execution count, and the
range's share of the kernel's samples: e.g. the epilogue, from the last WGMMA wait on.
`h200_run.sh profile` runs the first form on its report.
"""

import argparse
import collections
import csv
import io


def kernels(path):
    """(name, header, rows) per kernel section of ncu's source-page CSV."""
    sections = open(path).read().split('"Kernel Name"')[1:]
    for section in sections:
        lines = section.split("\n")
        name = lines[0].strip(",").strip('"')
        table = list(csv.reader(io.StringIO("\n".join(lines[1:]))))
        header = table[0]
        yield name, header, [row for row in table[1:] if len(row) == len(header)]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("csv")
    parser.add_argument("--top", type=int, default=12, help="instructions listed per kernel")
    parser.add_argument("--kernel", type=int, help="with --from/--to: the kernel (0 = first) to list a range of")
    parser.add_argument("--from", dest="start", help="first address of the range (hex)")
    parser.add_argument("--to", dest="end", help="last address of the range (hex)")
    args = parser.parse_args()
    for index, (name, header, rows) in enumerate(kernels(args.csv)):
        source = header.index("Source")
        samples = header.index("Warp Stall Sampling (All Samples)")
        executed = header.index("Instructions Executed")
        reasons = [i for i, h in enumerate(header) if h.startswith("stall_") and "Not Issued" not in h]
        total = sum(float(r[samples] or 0) for r in rows) or 1.0
        if args.kernel is not None:
            if index != args.kernel:
                continue
            lo, hi = int(args.start, 16), int(args.end, 16)
            inside = [r for r in rows if lo <= int(r[0], 16) <= hi]
            for r in inside:
                print(f"{r[0][-5:]} {float(r[samples] or 0):6.0f} executed={r[executed]:>8} {r[source][:70]}")
            share = sum(float(r[samples] or 0) for r in inside)
            print(f"range samples {share:.0f} of {total:.0f} ({share / total:.1%})")
            return
        by_reason = collections.Counter()
        for r in rows:
            for i in reasons:
                by_reason[header[i][len("stall_"):]] += float(r[i] or 0)
        print(f"== {name[:100]}: {total:.0f} samples, {len(rows)} instructions")
        print("   reasons: " + ", ".join(f"{k}={v / total:.1%}" for k, v in by_reason.most_common(8)))
        for r in sorted(rows, key=lambda r: -float(r[samples] or 0))[:args.top]:
            top = sorted(((float(r[i] or 0), header[i][len("stall_"):]) for i in reasons), reverse=True)[:3]
            why = " ".join(f"{k}={v:.0f}" for v, k in top if v)
            print(f"   {float(r[samples] or 0) / total:6.1%}  {r[0]:>6} {r[source][:60]:60s} {why}")


if __name__ == "__main__":
    main()

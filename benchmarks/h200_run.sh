#!/bin/bash
# The GPU steps on an H200, one per call, run from the repository root:
#
#   bash benchmarks/h200_run.sh tests    # GPU tests, 5 processes (compiling is what takes time)
#   bash benchmarks/h200_run.sh runtime  # compile / warm-load / per-call costs
#   bash benchmarks/h200_run.sh ops [D [MODE ...]]  # fused ops vs cuBLAS / eager / torch.compile
#                                                 # (MODE: default, max-autotune-no-cudagraphs;
#                                                 # OPS="RoPE bwd": only ops whose name contains a word;
#                                                 # TREE="base=scratch/base": also another checkout's
#                                                 # kernels, see bench_sm90.py --tree)
#   bash benchmarks/h200_run.sh variants [LABEL ...]  # ops with other tile/schedule/order/stage choices
#                                                    # (labels containing LABEL; D=2048: another d, 4096
#                                                    # by default; OPS as for ops)
#   bash benchmarks/h200_run.sh block [D ...]  # Llama MLP and block, forward + backward
#                                             # (MODES="default max-autotune-no-cudagraphs": torch.compile
#                                             # modes; CASES="MLP block LM": only those cases)
#   bash benchmarks/h200_run.sh programs [MxNxK ...]  # untuned programs: fused / our GEMM, default and
#                                                    # autotune, vs torch.compile (KINDS="library derived": only
#                                                    # those kinds; PROGRAMS="swiglu_bwd swiglu_backward": only
#                                                    # those programs; the kernels are built first by one
#                                                    # process per CPU)
#   bash benchmarks/h200_run.sh clocks [D]  # SM clock and board power per fused op vs its GEMM
#                                           # (OPS as for ops)
#   bash benchmarks/h200_run.sh sanitize  # compute-sanitizer memcheck + racecheck over the library
#   bash benchmarks/h200_run.sh profile [D [OP]]  # Nsight Compute: one fused op (a bench_sm90 name's
#                                                 # start) beside our GEMM and cuBLAS; log in $OUT
#
# Results and logs go to $OUT, else ./h200-out. Where the checkout has no .git, set CODA_COMMIT
# (the result files record it). Each step takes under 10 minutes at one d (`ops D default
# max-autotune-no-cudagraphs`: 2.5-4 minutes per d, most of it compiling). Result files are
# archived as benchmarks/results/archive/DATE-h200-<what>-<commit>.json; `python
# benchmarks/report.py` (on any machine) renders the newest into benchmarks/RESULTS.md.
set -u
step=${1:?tests, runtime, ops, variants, block, programs, clocks, sanitize or profile}
shift
out=${OUT:-h200-out}
mkdir -p "$out"
ops_tag=${OPS:+-$(echo "$OPS" | tr -c 'A-Za-z0-9\n' _)}  # result file names: -<the OPS words>
export PYTHONPATH=$PWD:${PYTHONPATH:-} CODA_CUTE_CACHE_DIR=${CODA_CUTE_CACHE_DIR:-/tmp/coda-cute-cache}
# Liger-Kernel, a contender of the block step (pure Python + Triton), where its wheel travels in
# .device/liger/ (`pip download --no-deps liger-kernel==0.8.5 -d .device/liger`)
liger_wheel=$(ls .device/liger/liger_kernel-*.whl 2>/dev/null | head -n 1)
if [ -n "$liger_wheel" ] && python -m zipfile -e "$liger_wheel" /tmp/liger-site; then
  export PYTHONPATH=$PYTHONPATH:/tmp/liger-site
fi
case $step in
  tests)
    i=0
    # five slices of 2-3 minutes each (the library's second slice alone took ~4 minutes)
    for k in "library_program and (300x528 or 1x272)" "library_program and (1000x784 or 129x1040)" \
             "library_program and not (300x528 or 1x272 or 1000x784 or 129x1040)" \
             "random_composition" "not library_program and not random_composition"; do
      i=$((i + 1))
      python -m pytest tests/test_gpu_kernels.py tests/test_gpu_nn.py tests/test_gpu_training.py tests/test_gpu_derive.py tests/test_autotune.py -q -p no:cacheprovider -k "$k" \
        > "$out/tests$i.log" 2>&1 &
    done
    wait
    tail -n 3 "$out"/tests*.log ;;
  runtime)
    # from a copy on the machine's local disk, with bytecode: the checkout's own filesystem on
    # the H200 hosts showed 100+ ms stalls importing single small modules (warm load is an import race)
    unset PYTHONDONTWRITEBYTECODE
    out=$(cd "$out" && pwd)
    rm -rf /tmp/coda-cute-runtime && cp -r . /tmp/coda-cute-runtime && cd /tmp/coda-cute-runtime || exit 1
    PYTHONPATH=$PWD:${PYTHONPATH#*:} python benchmarks/bench_runtime.py --out "$out/runtime.json" ;;
  ops)
    d=${1:-4096}
    shift || true
    python benchmarks/bench_sm90.py --d "$d" --compile-modes "${@:-default}" ${OPS:+--ops $OPS} \
      ${TREE:+--tree $TREE} --out "$out/ops-d$d$ops_tag.json" ;;
  variants)
    python benchmarks/bench_sm90.py --d "${D:-4096}" --variants "$@" ${OPS:+--ops $OPS} \
      --out "$out/variants-d${D:-4096}$ops_tag.json" ;;
  block)
    python benchmarks/bench_block.py --d "${@:-4096}" --compile-modes ${MODES:-default} \
      ${CASES:+--cases $CASES} --out "$out/block${CASES:+-$(echo $CASES | tr " " -)}.json" ;;
  programs)
    python benchmarks/bench_programs.py --kinds ${KINDS:-library random transcendental derived} \
      ${PROGRAMS:+--programs $PROGRAMS} --shapes "${@:-8192x4096x4096}" --out "$out/programs${KINDS:+-$(echo $KINDS | tr " " -)}-${1:-8192x4096x4096}.json" ;;
  clocks)
    python benchmarks/clocks.py --d "${1:-2048}" ${OPS:+--ops $OPS} \
      --out "$out/clocks-d${1:-2048}$ops_tag.json" ;;
  sanitize)
    python tests/gpu_sanitize.py > "$out/sanitize-warm.log" 2>&1 || { tail -n 20 "$out/sanitize-warm.log"; exit 1; }
    for tool in memcheck racecheck; do
      compute-sanitizer --tool "$tool" python tests/gpu_sanitize.py > "$out/sanitize-$tool.log" 2>&1
      echo "$tool: exit $?"; tail -n 3 "$out/sanitize-$tool.log"
    done ;;
  profile)
    # the full set (stall reasons, pc sampling) into a report, then the details page and the SASS
    # with per-instruction stall samples as text (the kernels: fused, our GEMM, cuBLAS)
    d=${1:-2048}
    shift || true
    op=${*:-O GEMM + residual}
    rep="$out/profile-d$d"
    ncu --profile-from-start off --set full -f -o "$rep" \
      python benchmarks/profile_op.py --d "$d" --op "$op" > "$rep.log" 2>&1
    echo "ncu: exit $?"; tail -n 3 "$rep.log"
    ncu -i "$rep.ncu-rep" --page details --print-details all > "$rep.txt" 2>&1
    ncu -i "$rep.ncu-rep" --page source --print-source sass --csv > "$rep-sass.csv" 2>&1
    echo "sass page: exit $? ($(wc -l < "$rep-sass.csv") lines)"
    grep -E "^  [a-zA-Z_].*\(|Duration" "$rep.txt" | head -n 20
    python benchmarks/ncu_stalls.py "$rep-sass.csv" --top 12 | tee "$rep-stalls.txt" ;;
  *)
    echo "unknown step $step: tests, runtime, ops, variants, block, clocks, sanitize or profile" >&2
    exit 2 ;;
esac

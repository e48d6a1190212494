#!/usr/bin/env bash
# The one prepared script for a lent GPU, in two calls that each fit 5 minutes of a 15-minute loan:
#   bash benchmarks/device_check.sh basics     # every op against its twin on the GPU, the CUDA tests (a CUDA-graph
#                                              # replay of the GraphSampler among them), sharded tests on CUDA shards
#   bash benchmarks/device_check.sh bench      # the GPU benchmarks, the tree-update scaling, the demo on CUDA
#   bash benchmarks/device_check.sh --dry-run [basics|bench]    # the plan, checked, without a GPU (runs nothing)
#   bash benchmarks/device_check.sh --simulate basics|bench     # the plan with every command replaced by echo
# Each step runs under its own `timeout`, pytest steps also under a per-test limit (GPUBUF_TEST_TIMEOUT); the
# step limits, their kill grace and the packing add up to at most BUDGET seconds per part (checked by the dry
# run). Everything a part writes is packed into ONE archive, $OUT/device_<part>.tar.gz (OUT defaults to
# ./device_out); a summary is printed last. Wheels missing on the GPU machine (benchmarks/device_wheels.txt:
# envpool, gymnasium and their needs) travel in .whl/ (benchmarks/fetch_device_wheels.sh fetches them here) and
# are installed under /tmp/gpubuf_site; gpubuf runs from the source tree via PYTHONPATH.
# Device tool calls:  run(command="bash benchmarks/device_check.sh basics", carry=[".whl"], timeout_s=300),
# then at once run(command="bash benchmarks/device_check.sh bench", carry=[".whl"], timeout_s=300).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
BUDGET=${DEVICE_CHECK_BUDGET:-285}  # seconds per part; the device call's own limit is 300
GRACE=3                             # timeout -k: seconds between TERM and KILL
PACK=10                             # seconds allowed for the archive and the summary
TEST_TIMEOUT=40                     # per test, in pytest steps
SITE=/tmp/gpubuf_site

MODE=run
PARTS=()
for a in "$@"; do
    case $a in
        --dry-run) MODE=dry ;;
        --simulate) MODE=simulate ;;
        basics|bench) PARTS+=("$a") ;;
        *) echo "device_check.sh: expected basics, bench, --dry-run or --simulate, got '$a'" >&2; exit 2 ;;
    esac
done
if [ ${#PARTS[@]} -eq 0 ]; then
    if [ "$MODE" = dry ]; then PARTS=(basics bench); else
        echo "device_check.sh: name a part: basics (first call) or bench (second call)" >&2; exit 2; fi
fi

PY=python3
WHEELS_INSTALL="if ls .whl/*.whl >/dev/null 2>&1; then $PY -m pip install -q --no-index --no-deps --no-compile \
--no-cache-dir --upgrade --target $SITE .whl/*.whl && ls $SITE; else echo 'no .whl/ carried: envpool and \
gymnasium tests and the demo are skipped'; fi"
PYTEST="$PY -m pytest -q -p no:cacheprovider -rs"

plan_basics() {
    step info 15 gpu.txt "$PY -m gpubuf.apps.cli info; nvidia-smi --query-gpu=name,memory.total,driver_version \
--format=csv; $PY -c 'import torch; print(\"gpus\", torch.cuda.device_count())'"
    step wheels 25 wheels.txt "$WHEELS_INSTALL"
    # every kernel against its twin on GPU tensors, launch counts, the simulated-device tests
    step kernel_tests 90 kernel_tests.txt "$PYTEST -m 'not cuda' tests/kernels/test_history_kernels.py \
tests/kernels/test_prefix_tree_kernels.py tests/ops/test_custom_ops.py tests/ops/test_launch_counts.py tests/ops/test_device_paths.py \
tests/replay/test_frame_stacks.py"
    # the cuda-marked tests: every op on the GPU vs its twin, the tree at 2**20 leaves, a CUDA graph replaying the
    # GraphSampler, host-memory storage serving CUDA batches, no host syncs, EnvPool on CUDA
    step cuda_tests 80 cuda_tests.txt "$PYTEST -m cuda tests"
    step distributed_tests 45 distributed_tests.txt "GPUBUF_TEST_DIST_DEVICE=cuda $PYTEST tests/replay/test_distributed.py"
}

plan_bench() {
    step info 10 gpu.txt "$PY -m gpubuf.apps.cli info; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader"
    step wheels 25 wheels.txt "$WHEELS_INSTALL"
    step history 30 history_cuda.md "$PY benchmarks/bench_history.py --device cuda --n-envs 1024 4096 --repeats 21 \
--no-deque --out \$W/history_cuda.json"
    step replay 35 replay_cuda.md "$PY benchmarks/bench_replay.py --device cuda --peers '' --log2-sizes 20,24 \
--batch 4096 --repeats 10 --out \$W/replay_cuda.json"
    step graph 15 graph_cuda.md "$PY benchmarks/bench_graph.py --device cuda --repeats 30 --out \$W/graph_cuda.json"
    step learner_step 17 learner_step_cuda.md "$PY benchmarks/bench_learner_step.py --device cuda --repeats 20 \
--out \$W/learner_step_cuda.json"
    step whole_step 15 whole_step_cuda.md "$PY benchmarks/bench_whole_step.py --device cuda --repeats 15 \
--out \$W/whole_step_cuda.json"
    step overhead 15 overhead_cuda.md "$PY benchmarks/bench_overhead.py --device cuda --repeats 200 && \
cp benchmarks/results/overhead_cuda.json \$W/"
    step tree_update 20 tree_update_cuda.md "$PY benchmarks/bench_tree_update.py --device cuda --log2-sizes 20,24 \
--repeats 7 --out \$W/tree_update_cuda.json"
    step distributed 25 distributed_cuda.md "if [ \$($PY -c 'import torch; print(torch.cuda.device_count())') -ge 2 ]; \
then $PY benchmarks/bench_distributed.py --backend nccl --device cuda --ranks 2 --log2-size 20 --batch 4096 \
--iters 30 --out \$W/distributed_nccl.json; else $PY benchmarks/bench_distributed.py --backend gloo --device cuda \
--ranks 1,2 --log2-size 20 --batch 4096 --iters 30 --out \$W/distributed_gloo_cuda.json; fi"
    step demo 35 demo_cuda.md "if $PY -c 'import envpool' 2>/dev/null; then $PY -m gpubuf.apps.cli demo --device cuda \
--env-steps 5000 --out \$W/demo_cuda.json --plot \$W/demo_cuda.png; else echo 'envpool missing: demo skipped'; fi"
}

TOTAL=0
NSTEPS=0
FAILED=0
step() {  # step NAME SECONDS LOGFILE COMMAND: run COMMAND under `timeout`, its output in $W/LOGFILE
    local name=$1 secs=$2 log=$3 cmd=$4
    TOTAL=$((TOTAL + secs + GRACE))
    NSTEPS=$((NSTEPS + 1))
    if [ "$MODE" = dry ]; then
        printf '%-18s %4ss  %-24s %s\n' "$name" "$secs" "$log" "$cmd"
        for f in $(grep -oE '(benchmarks|tests)/[A-Za-z0-9_./-]+\.(py|sh)' <<<"$cmd"); do
            [ -f "$f" ] || { echo "  missing file: $f"; FAILED=1; }
        done
        return 0
    fi
    local t0=$SECONDS rc
    if [ "$MODE" = simulate ]; then
        echo "$cmd" > "$W/$log"
        rc=0
    else
        echo "== $name (limit ${secs}s): $cmd" >&2
        GPUBUF_TEST_TIMEOUT=$TEST_TIMEOUT W=$W timeout -k $GRACE "$secs" bash -c "$cmd" > "$W/$log" 2>&1
        rc=$?
    fi
    local took=$((SECONDS - t0))
    printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$rc" "$took" "$secs" "$log" >> "$W/summary.tsv"
    [ "$rc" = 0 ] || FAILED=1
}

if [ "$MODE" = dry ]; then
    for PART in "${PARTS[@]}"; do
        TOTAL=0; NSTEPS=0
        echo "== part $PART: one call, archive \$OUT/device_$PART.tar.gz"
        "plan_$PART"
        TOTAL=$((TOTAL + PACK))
        echo "part $PART: $NSTEPS steps, limits + kill grace + packing = $TOTAL s of $BUDGET s"
        [ "$TOTAL" -le "$BUDGET" ] || { echo "part $PART: over budget"; FAILED=1; }
    done
    echo "== wheels (benchmarks/device_wheels.txt -> .whl/)"
    while read -r req; do
        [ -z "$req" ] || [ "${req:0:1}" = "#" ] && continue
        name=${req%%==*}; ver=${req#*==}; pat="$(tr '-' '_' <<<"$name")-$ver-"
        if ls .whl/ 2>/dev/null | grep -qi "^$pat"; then echo "present: $req"; else
            echo "absent: $req (run benchmarks/fetch_device_wheels.sh; without it the demo is skipped)"; fi
    done < benchmarks/device_wheels.txt
    carried=$(du -cb .whl/*.whl 2>/dev/null | tail -n 1 | cut -f1); carried=${carried:-0}
    tree=$( (git ls-files -z; git ls-files -z --others --exclude-standard) | du -cb --files0-from=- 2>/dev/null \
        | tail -n 1 | cut -f1)
    echo "travels: working tree $((tree / 1048576)) MiB + wheels $((carried / 1048576)) MiB of 64 MiB"
    [ $((tree + carried)) -lt $((64 * 1048576)) ] || { echo "over the 64 MiB a call carries"; FAILED=1; }
    [ "$FAILED" = 0 ] && echo "dry run: plan OK" || echo "dry run: plan FAILED"
    exit $FAILED
fi

PART=${PARTS[0]}
OUT=${OUT:-device_out}
mkdir -p "$OUT"
STAGE=$(mktemp -d)
W=$STAGE/device_$PART
mkdir -p "$W"
export PYTHONUNBUFFERED=1 W
# the installed layout maps kernels/ to gpubuf.kernels; from the source tree a link does (not when simulating)
[ "$MODE" = simulate ] || [ -e gpubuf/kernels ] || ln -s ../kernels gpubuf/kernels
export PYTHONPATH=$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}
START=$SECONDS
"plan_$PART"
{
    echo "part $PART: $((SECONDS - START)) s, mode $MODE"
    printf 'step\trc\tseconds\tlimit\tlog\n'
    cat "$W/summary.tsv"
} > "$W/README.txt"
tar -czf "$OUT/device_$PART.tar.gz" -C "$STAGE" "device_$PART"
rm -rf "$STAGE"
cat <<EOF
== device_check $PART: one archive, $OUT/device_$PART.tar.gz (step, rc, seconds, limit, log)
EOF
tar -xzOf "$OUT/device_$PART.tar.gz" "device_$PART/README.txt"
if [ "$MODE" = run ]; then  # the tails that matter, for the reply's output
    for f in gpu.txt kernel_tests.txt cuda_tests.txt distributed_tests.txt tree_update_cuda.md graph_cuda.md \
             history_cuda.md replay_cuda.md; do
        tar -xzOf "$OUT/device_$PART.tar.gz" "device_$PART/$f" 2>/dev/null | tail -n 12 | sed "s/^/[$f] /"
    done
fi
exit $FAILED

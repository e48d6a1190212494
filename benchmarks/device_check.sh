#!/usr/bin/env bash
# The one prepared script for a lent GPU (see the device tool): CUDA tests, then the benchmarks at GPU
# sizes. Installs nothing (the GPU machine has torch and triton but no registry); gpubuf runs from the
# source tree via PYTHONPATH. Full results go under $OUT; a short table is printed last.
#   run with: bash benchmarks/device_check.sh [all|tests|bench]      (OUT defaults to ./device_out)
# "tests" runs steps 1 and 2b (about 6 minutes at most), "bench" steps 2 and 3: two calls under the device
# tool's 10-minute limit per command, when one call of "all" might not fit.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-device_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# The source tree maps kernels/ to gpubuf.kernels when installed; without pip, link it in place.
[ -e gpubuf/kernels ] || ln -s ../kernels gpubuf/kernels
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
PART=${1:-all}
case $PART in all|tests|bench) ;; *) echo "device_check.sh: expected all, tests or bench, got '$PART'" >&2; exit 2;; esac
run() { [ "$PART" = all ] || [ "$PART" = "$1" ]; }
status=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"

# 1. the test suite on CUDA (Triton natively); modules needing absent packages are skipped by pytest
if run tests; then
timeout 240 python3 -m pytest -q -p no:cacheprovider tests 2>&1 | tee "$OUT/tests.txt" | tail -n 15 || status=1
fi

# 2. benchmarks at GPU sizes
if run bench; then
timeout 90 python3 benchmarks/bench_history.py --device cuda --n-envs 1024 4096 --repeats 51 --no-deque \
    --out "$OUT/history_cuda.json" > "$OUT/history_cuda.md" 2>&1 || status=1
timeout 120 python3 benchmarks/bench_replay.py --device cuda --peers "" --log2-sizes 20,24 --batch 4096 --repeats 20 \
    --out "$OUT/replay_cuda.json" > "$OUT/replay_cuda.md" 2>&1 || status=1

timeout 60 python3 benchmarks/bench_graph.py --device cuda --repeats 60 --out "$OUT/graph_cuda.json" \
    > "$OUT/graph_cuda.md" 2>&1 || status=1
timeout 60 python3 benchmarks/bench_overhead.py --device cuda --repeats 400 > "$OUT/overhead_cuda.md" 2>&1 || status=1
cp benchmarks/results/overhead_cuda.json "$OUT/" 2>/dev/null || true
fi

# 2b. sharded replay on the GPU: one rank per GPU over NCCL, 2 ranks over gloo with CUDA shards, and the
# distributed test scenarios with every shard on the GPU; the host-memory tier is in the CUDA tests of step 1
if run tests; then
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
timeout 100 python3 benchmarks/bench_distributed.py --backend nccl --device cuda --ranks "$NGPU" --log2-size 20 \
    --batch 4096 --iters 100 --out "$OUT/distributed_nccl.json" > "$OUT/distributed_nccl.md" 2>&1 || status=1
timeout 100 python3 benchmarks/bench_distributed.py --backend gloo --device cuda --ranks 1,2 --log2-size 20 \
    --batch 4096 --iters 50 --out "$OUT/distributed_gloo_cuda.json" > "$OUT/distributed_gloo_cuda.md" 2>&1 || status=1
GPUBUF_TEST_DIST_DEVICE=cuda timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_distributed.py \
    > "$OUT/distributed_tests_cuda.txt" 2>&1 || status=1
fi

# 3. the demo's learning run on the GPU (envpool may be missing there: reported, not fatal)
if run bench; then
if python3 -c "import envpool" 2>/dev/null; then
    timeout 200 python3 -m gpubuf.cli demo --device cuda --out "$OUT/demo_cuda.json" > "$OUT/demo_cuda.md" 2>&1 \
        || status=1
else
    echo "envpool missing on this machine: demo skipped" > "$OUT/demo_cuda.md"
fi
# gpubuf bench --quick on CUDA: the command's markdown, PNG chart and JSON (peers missing there are listed)
timeout 60 python3 -m gpubuf.cli bench --quick --device cuda --out "$OUT/bench_cuda.md" > "$OUT/bench_cuda.log" 2>&1 \
    || status=1
fi

show() { [ -f "$OUT/$2" ] && { echo "== $1 =="; tail -n "$3" "$OUT/$2"; }; }
show "HistoryBuffer on CUDA" history_cuda.md 40
show "Replay on CUDA" replay_cuda.md 20
show "GraphSampler: eager vs CUDA-graph replay" graph_cuda.md 20
show "host overhead on CUDA" overhead_cuda.md 12
show "sharded replay: NCCL" distributed_nccl.md 8
show "sharded replay: gloo, CUDA shards" distributed_gloo_cuda.md 8
show "distributed tests, CUDA shards" distributed_tests_cuda.txt 3
show "demo" demo_cuda.md 30
show "gpubuf bench --quick on CUDA" bench_cuda.md 60
exit $status

#!/usr/bin/env bash
# The one prepared script for a lent GPU (see the device tool): CUDA tests, then the benchmarks at GPU
# sizes. Installs nothing (the GPU machine has torch and triton but no registry); gpubuf runs from the
# source tree via PYTHONPATH. Full results go under $OUT; a short table is printed last.
#   run with: bash benchmarks/device_check.sh      (OUT defaults to ./device_out)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-device_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# The source tree maps kernels/ to gpubuf.kernels when installed; without pip, link it in place.
[ -e gpubuf/kernels ] || ln -s ../kernels gpubuf/kernels
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
status=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"

# 1. the test suite on CUDA (Triton natively); modules needing absent packages are skipped by pytest
timeout 200 python3 -m pytest -q -p no:cacheprovider tests 2>&1 | tee "$OUT/tests.txt" | tail -n 15 || status=1

# 2. benchmarks at GPU sizes
timeout 90 python3 benchmarks/bench_history.py --device cuda --n-envs 1024 4096 --repeats 51 --no-deque \
    --out "$OUT/history_cuda.json" > "$OUT/history_cuda.md" 2>&1 || status=1
timeout 120 python3 benchmarks/bench_replay.py --device cuda --peers "" --log2-sizes 20,24 --batch 4096 --repeats 20 \
    --out "$OUT/replay_cuda.json" > "$OUT/replay_cuda.md" 2>&1 || status=1

timeout 60 python3 benchmarks/bench_graph.py --device cuda --repeats 60 --out "$OUT/graph_cuda.json" \
    > "$OUT/graph_cuda.md" 2>&1 || status=1
timeout 60 python3 benchmarks/bench_overhead.py --device cuda --repeats 400 > "$OUT/overhead_cuda.md" 2>&1 || status=1
cp benchmarks/results/overhead_cuda.json "$OUT/" 2>/dev/null || true

# 3. the demo on the GPU (envpool is not installed there: reported, not fatal)
if python3 -c "import envpool" 2>/dev/null; then
    timeout 60 python3 -m gpubuf.cli demo --env Pong-v5 --num-envs 64 --steps 300 --out "$OUT/demo_cuda.json" \
        > "$OUT/demo_cuda.md" 2>&1 || status=1
else
    echo "envpool missing on this machine: demo skipped" > "$OUT/demo_cuda.md"
fi

echo "== HistoryBuffer on CUDA =="; cat "$OUT/history_cuda.md"
echo "== Replay on CUDA =="; tail -n 20 "$OUT/replay_cuda.md"
echo "== GraphSampler: eager vs CUDA-graph replay =="; cat "$OUT/graph_cuda.md"
echo "== host overhead on CUDA =="; tail -n 12 "$OUT/overhead_cuda.md"
echo "== demo =="; cat "$OUT/demo_cuda.md"
exit $status

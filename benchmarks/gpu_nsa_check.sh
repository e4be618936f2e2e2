#!/bin/bash
# One device check for the NSA Triton kernels: benchmark (with --tune), then the kernel tests compiled on the GPU.
# Results land in $OUT (gpu_nsa.json, bench.log, pytest.log). Budget: BENCH_S + TEST_S seconds (default 400).
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/nsa_out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
python -c "import fla; print('fla', fla.__version__)" 2>&1 | tail -1
timeout "${BENCH_S:-280}" python benchmarks/gpu_nsa.py --tune --out "$OUT/gpu_nsa.json" > "$OUT/bench.log" 2>&1
echo "bench rc=$?"
grep -v '^  File\|^    ' "$OUT/bench.log" | tail -60
timeout "${TEST_S:-120}" python -m pytest tests/nsa/test_nsa_triton.py -q -x -p no:cacheprovider > "$OUT/pytest.log" 2>&1
echo "pytest rc=$?"
tail -25 "$OUT/pytest.log"

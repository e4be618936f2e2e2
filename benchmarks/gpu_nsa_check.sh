#!/bin/bash
# One device check for the NSA Triton kernels: benchmark (with --tune), then the kernel tests compiled on the GPU.
# Results land in $OUT (gpu_nsa.json, written after every stage; bench.log; pytest.log).
# Budget: BENCH_S + TEST_S seconds (default 330 + 100). The device machine cannot reach a package index:
# carry the peer and pytest in .peers (`make peers` here, then run with carry: [".peers"]).
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/nsa_out}
mkdir -p "$OUT"
if [ -d .peers ]; then export PYTHONPATH="$PWD/.peers${PYTHONPATH:+:$PYTHONPATH}"; fi
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
# find_spec, not import: importing fla takes up to a minute, and the benchmark imports it once anyway
python -c "import importlib.util as u; print({m: bool(u.find_spec(m)) for m in ('fla', 'einops', 'pytest', 'xdist')})"
timeout "${BENCH_S:-330}" python benchmarks/gpu_nsa.py --tune --out "$OUT/gpu_nsa.json" > "$OUT/bench.log" 2>&1
echo "bench rc=$?"
grep -v '^  File\|^    ' "$OUT/bench.log" | tail -60
# the tests compile ~200 kernel variants (1-2 s each): in 8 processes when pytest-xdist is there (make peers carries it)
XDIST=$(python -c "import importlib.util as u; print('-n 8' if u.find_spec('xdist') else '')")
timeout "${TEST_S:-100}" python -m pytest tests/nsa/test_nsa_triton.py -q -x -p no:cacheprovider $XDIST > "$OUT/pytest.log" 2>&1
echo "pytest rc=$?"
tail -25 "$OUT/pytest.log"

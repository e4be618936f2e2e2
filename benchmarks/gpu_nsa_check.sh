#!/bin/bash
# One device check for the NSA Triton kernels: benchmark (with --tune), then the kernel tests compiled on the GPU.
# Results land in $OUT (gpu_nsa.json, written after every stage; bench.log; pytest.log).
# Budget: BENCH_S + TEST_S seconds (default 330 + 100); give the device run a timeout of >= 480 s. The device
# machine cannot reach a package index: carry the peer and pytest in .peers (`make peers` here, then run with
# carry: [".peers"]). No `set -e`: each step runs whatever the one before it did.
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/nsa_out}
mkdir -p "$OUT"
PY=$(command -v python3 || command -v python)
if [ -d .peers ]; then export PYTHONPATH="$PWD/.peers${PYTHONPATH:+:$PYTHONPATH}"; fi
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
# find_spec, not import: importing fla takes up to a minute, and the benchmark imports it once anyway
$PY -c "import importlib.util as u; print({m: bool(u.find_spec(m)) for m in ('fla', 'einops', 'pytest', 'xdist')})"
timeout -k 10 "${BENCH_S:-330}" $PY benchmarks/gpu_nsa.py --tune --out "$OUT/gpu_nsa.json" > "$OUT/bench.log" 2>&1
echo "bench rc=$?"
grep -v '^  File\|^    ' "$OUT/bench.log" | tail -60
# the tests compile ~200 kernel variants (1-2 s each): in 8 processes when pytest-xdist is there (make peers carries
# it). The image's own pytest plugins are not loaded (the carried pytest may not match them); -v: a line per test,
# so a run cut by the timeout still says which tests passed
XDIST=$($PY -c "import importlib.util as u; print('-p xdist.plugin -n 8' if u.find_spec('xdist') else '')")
PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 timeout -k 10 "${TEST_S:-100}" $PY -m pytest tests/nsa/test_triton_impl.py tests/nsa/test_triton_plan.py -v -x \
    -p no:cacheprovider $XDIST > "$OUT/pytest.log" 2>&1
echo "pytest rc=$?"
grep -E "FAILED|ERROR|passed|failed" "$OUT/pytest.log" | tail -25

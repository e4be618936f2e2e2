#!/bin/bash
# The whole-stack GPU check, one command: the MoE layer (fwd/bwd vs the float64 oracle, NCCL EP at world size 1,
# and 2 where two GPUs exist), the transformers experts backend in bf16 beside grouped_mm, NativeSparseAttention
# fwd/bwd, `sparseops train` for a few steps, the NSA Triton benchmark (--quick) and the compiled Triton kernel
# tests; one table at the end (benchmarks/gpu_check.py, docs/perf.md "The GPU check"). Results in $OUT:
# gpu_check.json (written after every row), gpu_nsa.json, and a log per subprocess row.
# Budget: under 8 minutes on one H200 (--budget 450 s for the rows, each subprocess row within its own
# timeout too, gpu_check.TIMEOUTS); give the device run a timeout of >= 540 s. The device machine cannot reach a package index: carry the peers and
# pytest in .peers (`make peers` here, then run with carry: [".peers"]).
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check_out}
mkdir -p "$OUT"
PY=$(command -v python3 || command -v python)
if [ -d .peers ]; then export PYTHONPATH="$PWD/.peers${PYTHONPATH:+:$PYTHONPATH}"; fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"
$PY -c "import importlib.util as u; print({m: bool(u.find_spec(m)) for m in ('transformers', 'fla', 'einops', 'pytest', 'xdist')})"
# --budget: the subprocess rows get what is left of it; the timeout only catches a hung in-process row
timeout -k 10 "${CHECK_S:-520}" $PY benchmarks/gpu_check.py --out "$OUT" --budget "${BUDGET_S:-450}" "$@"
echo "gpu_check rc=$?"

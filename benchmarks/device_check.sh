#!/usr/bin/env bash
# One-command GPU check: the CUDA test suite, then the measurements (benchmarks/device_check.py).
#
#   bash benchmarks/device_check.sh                  # writes $OUT (default docs/results): gpu.json, the suite's
#                                                    # junit XML and logs; ~5-7 min on one H200
#   OUT=/tmp/x bash benchmarks/device_check.sh --device cpu --tiny --only codec   # the glue, on a CPU (CI)
#
# Arguments go to device_check.py. Environment: OUT (where results go), PYTHON (default python3),
# BIRDER_DEVICE_TESTS=0 (skip the test suite), TESTS_TIMEOUT / MEASURE_TIMEOUT (seconds, default 300 / 180),
# BIRDER_INSTALL=1 (no CUDA torch on PYTHON: make .venv-gpu and pip-install the project with constraints/ci.txt;
# needs a package index, which the lent GPU machines do not have).
#
# The project is not pip-installed by default: src/ goes on PYTHONPATH. A lent GPU machine has torch, triton,
# transformers, timm, accelerate and pytest but no package index (an editable install would need hatchling).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-docs/results}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
log() { echo "[device_check $(date +%H:%M:%S)] $*"; }

if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    if [ "${BIRDER_INSTALL:-0}" = 1 ]; then
        log "no CUDA torch on $PY: installing into .venv-gpu (constraints/ci.txt)"
        python3 -m venv .venv-gpu && .venv-gpu/bin/pip install -q -c constraints/ci.txt -e ".[test]" || exit 2
        PY=.venv-gpu/bin/python
    else
        log "no CUDA device visible to $PY: the CUDA tests will skip (set BIRDER_INSTALL=1 to install torch)"
    fi
fi
"$PY" - <<'EOF'
import importlib.metadata, importlib.util, platform
import torch
print("python", platform.python_version(), "| torch", torch.__version__, "| cuda", torch.version.cuda,
      "|", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device")
print("  birder_hf from", importlib.util.find_spec("birder_hf").origin)
for name in ("pytest", "pytest-timeout", "triton", "transformers", "timm", "accelerate"):
    try:
        print(f"  {name} {importlib.metadata.version(name)}")
    except importlib.metadata.PackageNotFoundError:
        print(f"  {name} MISSING: the tests and measurements that need it fail and say so")
EOF

JUNIT="$OUT/gpu_junit.xml"
if [ "${BIRDER_DEVICE_TESTS:-1}" != 0 ]; then
    # only the CUDA suite's files: collecting the others would import packages a GPU image may lack (datasets)
    log "test suite: pytest -m 'gpu or multi_gpu' tests/test_gpu_*.py"
    per_test=()  # a hung test must not eat the whole budget (pytest-timeout, where installed)
    "$PY" -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout 150)
    timeout -s INT -k 20 "${TESTS_TIMEOUT:-300}" "$PY" -m pytest -m "gpu or multi_gpu" -q -rfEsxX -p no:cacheprovider \
        ${per_test[@]+"${per_test[@]}"} --junitxml "$JUNIT" tests/test_gpu_*.py 2>&1 | tee "$OUT/gpu_tests.log"
    log "test suite exit status ${PIPESTATUS[0]} (124: cut at ${TESTS_TIMEOUT:-300} s; its junit XML is then partial)"
else
    JUNIT=""
fi

log "measurements: benchmarks/device_check.py $*"
timeout -s INT -k 20 "${MEASURE_TIMEOUT:-180}" "$PY" benchmarks/device_check.py --out "$OUT/gpu.json" ${JUNIT:+--junit "$JUNIT"} "$@" \
    2>&1 | tee "$OUT/device_check.log"
status=${PIPESTATUS[0]}
log "measurements exit status $status; results in $OUT"
exit "$status"

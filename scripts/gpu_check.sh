#!/usr/bin/env bash
# Build and check the CUDA data plane on a machine with a GPU (no network needed), in one go:
#   scripts/gpu_check.sh [smoke|tests|bench|all]   (default: all)
# smoke: the kernels alone in one process (tests/test_cuda_sim.py -k gpu), then one R=2 round trip
# against shm; tests: tests/test_cuda.py, tests/test_cuda_sim.py and tests/test_cuda_build.py;
# bench: `python -m mooncake_ep_switch.bench --device cuda`. Logs and the benchmark table go to
# $OUT (default /tmp/mep_gpu_out). With MEP_GPU_MPS=1 an MPS daemon is started first (and stopped
# at the end) so that the rank processes' kernels run concurrently instead of time-sliced.
set -uo pipefail
cd "$(dirname "$0")/.."
stage=${1:-all}
OUT=${OUT:-/tmp/mep_gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}

nvidia-smi --query-gpu=name,driver_version,memory.total,compute_mode --format=csv 2>&1 | tee "$OUT/device.txt"
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))" \
  2>&1 | tee -a "$OUT/device.txt"
$PY -m pip install -q --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
$PY -c "from mooncake_ep_switch import _cuda; print('cuda devices', _cuda.device_count(), repr(_cuda.device_status()))" \
  2>&1 | tee -a "$OUT/device.txt"

mps_started=0
if [ "${MEP_GPU_MPS:-0}" = 1 ] && command -v nvidia-cuda-mps-control >/dev/null; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mep-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mep-mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d && mps_started=1 && echo "MPS daemon started" | tee -a "$OUT/device.txt"
fi
stop_mps() { [ "$mps_started" = 1 ] && echo quit | nvidia-cuda-mps-control; }
trap stop_mps EXIT

status=0
if [ "$stage" = smoke ] || [ "$stage" = all ]; then
  # The kernels alone in one process (no IPC, no time-slicing), against the CPU kernels; then one
  # round trip of the transport at R=2.
  timeout 240 $PY -m pytest -q -x -p no:cacheprovider tests/test_cuda_sim.py -k gpu 2>&1 | tee "$OUT/smoke.log" \
    || status=1
  [ "$status" = 0 ] && { timeout 240 $PY -m pytest -q -x -p no:cacheprovider \
    "tests/test_cuda.py::test_cuda_matches_shm[sync-bf16-2]" 2>&1 | tee -a "$OUT/smoke.log" || status=1; }
fi
if { [ "$stage" = tests ] || [ "$stage" = all ]; } && [ "$status" = 0 ]; then
  timeout 480 $PY -m pytest -q -p no:cacheprovider -rs --durations=15 tests/test_cuda.py tests/test_cuda_sim.py \
    tests/test_cuda_build.py 2>&1 | tee "$OUT/tests.log" || status=1
fi
if [ "$stage" = bench ] || { [ "$stage" = all ] && [ "$status" = 0 ]; }; then
  timeout 480 $PY -m mooncake_ep_switch.bench --device cuda --out "$OUT/bench.md" 2>&1 | tee "$OUT/bench.log" \
    || status=1
fi
exit $status

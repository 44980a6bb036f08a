#!/usr/bin/env bash
# Bounded GPU check of the CUDA data plane, for a few minutes on a machine with a GPU (no network).
# Every stage has a hard cap AND the whole run ends by one deadline (MEP_CHECK_BUDGET_S, default 420 s),
# so a hang in one stage still leaves the others' logs; stages are stopped with SIGINT so pytest prints
# its summary. At most 8 files under $OUT (only those come back from a lent machine): env.txt build.log
# kernels.log transport.log switch.log bench.log bench.md summary.txt.
#   MEP_STAGES="build kernels probe transport graph fault fused switch demo bench hostprof rest mps"   (default: all)
#     build      setup.py build_ext --inplace, parallel; FAILS (exit 1) when _cuda is missing or sees no device
#     kernels    tests/test_cuda_sim.py (its GPU cells): the nvcc kernels alone in one process against the CPU kernels
#                (the combine with biases too)
#     probe      scripts/gpu_probe.py: H=7168 bit-exactness, an R=8 E=256 round past 2^31, kernel-only times,
#                each for the split and the fused launches (interleaved A/B)
#     transport  tests/test_cuda.py round trips at R=2 and R=4 (rank processes on the one GPU), against shm;
#                a combine starting from biases (tests/test_combine_bias.py, the Buffer's and the ElasticBuffer's)
#     graph      the CUDA graph replay test (again with CUDA_MODULE_LOADING=EAGER if it fails)
#     fault      a rank SIGKILLed between dispatch and combine, and before dispatch; Xid lines from dmesg
#     fused      the transport, graph and fault tests again with MEP_CUDA_FUSED_KERNELS=1 (the fused launches
#                in rank processes; the kernels and probe stages already ran them in one process)
#     switch     tests/test_switch_device.py -k gpu: TP<->EP switches of weights and KV (also with every move the
#                block-copy kernel), a rank killed in a switch, an EPLB abort and commit, a replacement restored
#                from device copies (vs the host path), the block-copy kernel against the host copy
#     demo       python -m mooncake_ep_switch demo --device cuda (switches, online EPLB, a rank replaced)
#     bench      python -m mooncake_ep_switch.bench --device cuda --quick
#     hostprof   scripts/cuda_host_profile.py: the host's time in eager T=1 round trips, split and fused launches;
#                scripts/switch_host_profile.py --emulated: the host's time in a switch's weight and KV phases;
#                cuda_host_profile.py --emulated: the Python layer alone on this CPU (against CI's box)
#     rest       the rest of tests/test_cuda.py, with whatever budget is left
#     mps        the R=4 rounds again under MPS, if the image has nvidia-cuda-mps-control
#   MEP_TRANSPORT_TESTS="<pytest node ids>"    override the transport selection (follow-up runs)
#   MEP_PROBE_ARGS="--profile --skip-r8"        arguments of the probe (follow-up runs); "--sweep" times the launch
#                                               tuning grid (Call.row_warps x Call.grid_blocks) per launch variant
# The speed issue's A/B in one call (kernels alone both ways, the tuning sweep, the MPS bench both ways, the
# full-shape switch under MPS):
#   MEP_STAGES="build kernels probe fused switch hostprof mps" MEP_PROBE_ARGS="--profile --sweep --skip-r8" \
#   MEP_MPS_BENCH=1 MEP_MPS_SWITCH=1
#   MEP_TRY_MPS=0                               skip the MPS stage
#   MEP_MPS_SWITCH=1                            also the switch rows at the full shape under MPS (3 GiB of weights
#                                               a rank: the reshard and KV targets), into bench.log
#   MEP_MPS_BENCH=1                             also the bench (--quick) under MPS, its table into bench.log, with
#                                               the split launches and then with MEP_CUDA_FUSED_KERNELS=1
#   MEP_PIP_CHECK=0                             skip the background offline `pip wheel` of the package
#   MEP_ALLOW_NO_DEVICE=1                       dry run of the machinery on a machine without a GPU
# Prebuilt modules (mooncake_ep_switch/*.so) are used when they import from this tree (MEP_FORCE_BUILD=1 rebuilds).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/mep_gpu_out}
mkdir -p "$OUT"
BUDGET=${MEP_CHECK_BUDGET_S:-420}
DEADLINE=$(( $(date +%s) + BUDGET ))
STAGES=" ${MEP_STAGES:-build kernels probe transport graph fault fused bench hostprof rest mps} "
export PATH="$PATH:/usr/local/cuda/bin" PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
export MEP_TEST_RUN_TIMEOUT_S=${MEP_TEST_RUN_TIMEOUT_S:-45}   # harness.run deadline: hangs dump rank stacks
PY=${PYTHON:-python3}
SUM="$OUT/summary.txt"
: > "$SUM"
PT=($PY -m pytest -q -p no:cacheprovider -rfEs --durations=10 -o faulthandler_timeout=50)
want() { [[ "$STAGES" == *" $1 "* ]]; }
stage() {  # stage NAME CAP LOG command...
  local name=$1 cap=$2 log=$3; shift 3
  local left=$(( DEADLINE - $(date +%s) - 8 ))
  if [ "$left" -lt 25 ]; then echo "$name: SKIPPED (budget left ${left}s)" >> "$SUM"; return 0; fi
  [ "$cap" -gt "$left" ] && cap=$left
  local t0=$(date +%s)
  echo "=== $name (cap ${cap}s) $(date +%T) ===" >> "$log"
  timeout -s INT -k 10 "$cap" "$@" >> "$log" 2>&1
  local rc=$?
  echo "$name: rc=$rc $(( $(date +%s) - t0 ))s (cap ${cap}s)$([ $rc = 124 ] && echo ' TIMED OUT')" >> "$SUM"
  return $rc
}
xid() { echo "--- Xid / NVRM after $1:"; timeout 5 dmesg 2>/dev/null | grep -iE "xid|nvrm" | tail -8; }

{ date; timeout 20 nvidia-smi --query-gpu=name,driver_version,memory.total,compute_mode,mig.mode.current --format=csv
  timeout 20 nvidia-smi -q 2>/dev/null | grep -iE "virtualization mode|compute mode|persistence" | sort -u
  echo "mps: $(command -v nvidia-cuda-mps-control || echo absent)"; nvcc --version | tail -1; gcc --version | head -1
  $PY -c "import sys,torch,setuptools,pybind11; print(sys.version.split()[0], 'torch', torch.__version__, torch.version.cuda, 'setuptools', setuptools.__version__, 'pybind11', pybind11.__version__)"
  echo "nproc $(nproc) CUDA_MODULE_LOADING=${CUDA_MODULE_LOADING:-unset}"; xid start; } > "$OUT/env.txt" 2>&1

if want build; then
  if $PY -c "import os, mooncake_ep_switch as m; from mooncake_ep_switch import _cuda, _native, _cuda_sim
assert all(x.__file__.startswith(os.getcwd()) for x in (m, _cuda, _native, _cuda_sim))" 2>/dev/null && [ "${MEP_FORCE_BUILD:-0}" != 1 ]; then
    echo "build: prebuilt modules import; not rebuilt" >> "$SUM"
  else
    # pybind11's ParallelCompile compiles _native's sources in parallel; -j3 builds the 3 modules at once.
    stage build 200 "$OUT/build.log" $PY -c "
import runpy, sys
from pybind11.setup_helpers import ParallelCompile
ParallelCompile('MEP_BUILD_JOBS', default=0).install()
sys.argv = ['setup.py', 'build_ext', '--inplace', '-j', '3']
runpy.run_path('setup.py', run_name='__main__')"
  fi
fi
if want build && [ "${MEP_PIP_CHECK:-1}" = 1 ]; then
  # The documented install path (pip, offline, no build isolation) in a copy, in the background.
  rm -rf /tmp/mep_pipcheck /tmp/mep_pip.log && cp -r . /tmp/mep_pipcheck && rm -rf /tmp/mep_pipcheck/build \
    /tmp/mep_pipcheck/mooncake_ep_switch/*.so
  setsid bash -c "cd /tmp/mep_pipcheck && PIP_NO_INDEX=1 nice -n 10 $PY -m pip wheel -q \
    --no-build-isolation --no-deps -w dist . > /tmp/mep_pip.log 2>&1; echo pip wheel rc=\$? >> /tmp/mep_pip.log" &
  PIP_PID=$!
fi
if ! $PY -c "
from mooncake_ep_switch import _cuda
n = _cuda.device_count(); print('cuda devices', n, repr(_cuda.device_status())); assert n > 0" >> "$SUM" 2>&1; then
  echo "FATAL: mooncake_ep_switch._cuda missing or no device: every GPU test would SKIP" >> "$SUM"
  [ "${MEP_ALLOW_NO_DEVICE:-0}" = 1 ] || { [ -n "${PIP_PID:-}" ] && kill -- -"$PIP_PID" 2>/dev/null; cat "$SUM"; exit 1; }
fi

# The file's GPU cells (the whole file carries the gpu tier marker, so -k gpu would select the emulator's too)
want kernels && stage kernels 100 "$OUT/kernels.log" "${PT[@]}" --maxfail=4 tests/test_cuda_sim.py \
  -k "not emulator and not dry_runs" tests/test_cuda_build.py::test_cuda_module_was_built_with_hopper_code
want probe && stage probe 150 "$OUT/bench.log" $PY scripts/gpu_probe.py ${MEP_PROBE_ARGS:-}
T=tests/test_cuda.py
if [ -n "${MEP_TRANSPORT_TESTS:-}" ]; then read -r -a TRANSPORT <<< "$MEP_TRANSPORT_TESTS"; else
  TRANSPORT=("$T::test_the_raw_stream_is_torchs_current_stream" "$T::test_cuda_matches_shm[sync-bf16-2]"
    "$T::test_cuda_matches_shm[sync-bf16-4]"
    "$T::test_cuda_matches_shm[sync-fp8-4]" "$T::test_cuda_matches_shm[hook-bf16-2]"
    "$T::test_cuda_matches_shm[async-fp8-4]" "$T::test_cuda_two_dispatches_in_a_row[async]"
    "$T::test_cuda_two_dispatches_in_a_row[mixed]" "$T::test_cuda_two_dispatches_in_a_row[side]"
    "$T::test_deep_ep_hook_run_under_a_side_stream" "$T::test_cuda_zero_copy_and_out[True-True]"
    "$T::test_cuda_inactive_rank[4]"
    "tests/test_combine_bias.py::test_a_bias_on_the_gpu" "$T::test_cuda_hot_path"); fi
want transport && stage transport 170 "$OUT/transport.log" "${PT[@]}" --maxfail=3 "${TRANSPORT[@]}"
if want graph && ! stage graph 70 "$OUT/transport.log" "${PT[@]}" "$T::test_cuda_graph_replays_match_eager"; then
  # A lazily loaded kernel inside a capture is the first suspect: the same test with every module loaded eagerly.
  CUDA_MODULE_LOADING=EAGER stage graph-eager 60 "$OUT/transport.log" "${PT[@]}" "$T::test_cuda_graph_replays_match_eager"
fi
want fault && stage fault 110 "$OUT/transport.log" "${PT[@]}" "$T::test_cuda_rank_killed[between]" \
  "$T::test_cuda_rank_killed[before_dispatch]"
want fault && xid fault >> "$SUM" 2>&1
FUSED=("$T::test_cuda_matches_shm[sync-bf16-2]" "$T::test_cuda_matches_shm[sync-fp8-4]"
  "$T::test_cuda_matches_shm[async-fp8-4]" "$T::test_cuda_two_dispatches_in_a_row[async]"
  "$T::test_cuda_two_dispatches_in_a_row[mixed]" "$T::test_cuda_two_dispatches_in_a_row[side]"
  "$T::test_deep_ep_hook_run_under_a_side_stream" "$T::test_cuda_inactive_rank[4]"
  "$T::test_cuda_graph_replays_match_eager" "$T::test_cuda_rank_killed[between]"
  "$T::test_cuda_rank_killed[before_dispatch]" "tests/test_combine_bias.py::test_a_bias_on_the_gpu"
  "$T::test_cuda_hot_path")
want fused && MEP_CUDA_FUSED_KERNELS=1 stage fused 170 "$OUT/transport.log" "${PT[@]}" --maxfail=3 "${FUSED[@]}"
want fused && xid fused >> "$SUM" 2>&1
want switch && stage switch 170 "$OUT/switch.log" "${PT[@]}" tests/test_switch_device.py -k gpu
want switch && xid switch >> "$SUM" 2>&1
want demo && stage demo 120 "$OUT/switch.log" $PY -m mooncake_ep_switch demo --device cuda --out /tmp/mep_demo_out
want bench && stage bench 150 "$OUT/bench.log" $PY -m mooncake_ep_switch.bench --device cuda --quick --out "$OUT/bench.md"
want hostprof && stage hostprof 60 "$OUT/bench.log" $PY scripts/cuda_host_profile.py --rounds 300 --top 25
want hostprof && stage hostprof-fused 60 "$OUT/bench.log" $PY scripts/cuda_host_profile.py --rounds 300 --top 25 --fused
# The Python layer alone on this host's CPU (no-op launchers): against CI's box, whose figures docs/benchmarks.md has
want hostprof && stage hostprof-python 40 "$OUT/bench.log" $PY scripts/cuda_host_profile.py --emulated --ranks 1 \
  --rounds 2000 --top 0
# The host alone in a switch's weight and KV phases, on this host's CPU (against the bench's reshard and KV rows)
want hostprof && stage hostprof-switch 60 "$OUT/bench.log" $PY scripts/switch_host_profile.py --emulated --iters 5
if want rest; then
  # Whatever budget is left: the rest of the transport file (the stages above ran the rest of its tests).
  DESELECT=()
  for t in "${TRANSPORT[@]}" "$T::test_cuda_graph_replays_match_eager" "$T::test_cuda_rank_killed[between]" \
    "$T::test_cuda_rank_killed[before_dispatch]"; do DESELECT+=(--deselect "$t"); done
  stage rest 150 "$OUT/transport.log" "${PT[@]}" "$T" "${DESELECT[@]}"
fi

# Last: the same R=4 rounds under MPS (concurrent kernels instead of time-slicing), if the image has it.
if want mps && [ "${MEP_TRY_MPS:-1}" = 1 ] && command -v nvidia-cuda-mps-control >/dev/null \
   && [ $(( DEADLINE - $(date +%s) )) -gt 70 ]; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mep-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mep-mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  if timeout 15 nvidia-cuda-mps-control -d; then
    stage mps 60 "$OUT/transport.log" "${PT[@]}" --maxfail=1 "$T::test_cuda_matches_shm[sync-bf16-4]" \
      "$T::test_cuda_matches_shm[async-fp8-4]"
    [ "${MEP_MPS_BENCH:-0}" = 1 ] && stage mps-bench 60 "$OUT/bench.log" $PY -m mooncake_ep_switch.bench --device cuda --quick
    [ "${MEP_MPS_BENCH:-0}" = 1 ] && MEP_CUDA_FUSED_KERNELS=1 stage mps-bench-fused 60 "$OUT/bench.log" \
      $PY -m mooncake_ep_switch.bench --device cuda --quick
    [ "${MEP_MPS_SWITCH:-0}" = 1 ] && stage mps-switch 120 "$OUT/bench.log" \
      $PY -m mooncake_ep_switch.bench --device cuda switch
    echo quit | timeout 10 nvidia-cuda-mps-control
    tail -5 "$CUDA_MPS_LOG_DIRECTORY"/control.log >> "$SUM" 2>/dev/null
  else echo "mps: daemon did not start" >> "$SUM"; fi
fi

wait_left=$(( DEADLINE - $(date +%s) - 3 ))
[ -n "${PIP_PID:-}" ] && [ "$wait_left" -gt 0 ] && \
  timeout "$wait_left" bash -c 'until grep -q "pip wheel rc" /tmp/mep_pip.log 2>/dev/null; do sleep 1; done'
{ echo "--- pip wheel (offline, --no-build-isolation):"; tail -3 /tmp/mep_pip.log 2>/dev/null
  xid end
  echo "--- GPU processes left:"; timeout 10 nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader
  echo "--- grep of results:"; grep -hE "passed|failed|error|EXACT|LARGE|TIME |PROBE|SKIPPED|demo (PASS|FAIL)" \
    "$OUT"/kernels.log "$OUT"/transport.log "$OUT"/switch.log "$OUT"/bench.log 2>/dev/null | tail -40
} >> "$SUM" 2>&1
[ -n "${PIP_PID:-}" ] && kill -- -"$PIP_PID" 2>/dev/null
cat "$SUM"

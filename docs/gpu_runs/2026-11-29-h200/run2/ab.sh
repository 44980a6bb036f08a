#!/usr/bin/env bash
# One-off A/B on the GPU: e959eed's kernels (.before) against the working tree's, same run.
set -u
D=$(date +%s)
(cd .before && python3 setup.py build_ext --inplace -j 3 > /tmp/bb.log 2>&1; echo before-build rc=$? >> /tmp/bb.log) &
BP=$!
MEP_STAGES="build kernels" MEP_PIP_CHECK=0 MEP_CHECK_BUDGET_S=110 bash scripts/gpu_check.sh > /dev/null
wait $BP; tail -3 /tmp/bb.log > $OUT/before_build.txt
for v in before after before after; do
  if [ $v = before ]; then d=.before; else d=.; fi
  echo "=== PROBE-$v $(date +%T)" >> $OUT/probe_ab.log
  (cd $d && timeout 40 python3 scripts/gpu_probe.py --profile --skip-r8 >> $OUT/probe_ab.log 2>&1)
done
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mep-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mep-mps-log
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
timeout 15 nvidia-cuda-mps-control -d
for v in before after before after; do
  if [ $v = before ]; then d=.before; else d=.; fi
  echo "=== MPS-BENCH-$v $(date +%T)" >> $OUT/mps_ab.log
  (cd $d && timeout 45 python3 -m mooncake_ep_switch.bench --device cuda --quick >> $OUT/mps_ab.log 2>&1)
done
echo quit | timeout 10 nvidia-cuda-mps-control
echo "total $(( $(date +%s) - D ))s"
cat $OUT/summary.txt | grep -v NVRM; cat $OUT/before_build.txt
grep -E "PROBE-|^TIME|device busy" $OUT/probe_ab.log | cut -c1-200
grep -E "MPS-BENCH-|cuda dispatch|T=1 round" $OUT/mps_ab.log | cut -c1-150

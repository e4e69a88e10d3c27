#!/usr/bin/env bash
# The GPU checks a CPU machine cannot run, in one go (a few minutes on one GPU):
#   bash tools/gpu-check.sh OUT_DIR [PYTHON]
# 1. tests/gpu (Megatron on CUDA + NCCL, the GRPO update there, release/resume of every group's
#    device memory, the bounded stop giving up a long colocated step on the device, the SGLang
#    engine when sglang is installed);
# 2. the demo loop on one GPU with full colocation (configs/demo_1gpu.yaml, 3 ranks, 1 device),
#    whose timeline records each rank's device memory at the end of every phase.
# Logs, metrics and the timeline land in OUT_DIR.
set -uo pipefail
out=${1:?usage: tools/gpu-check.sh OUT_DIR [PYTHON]}
py=${2:-python3}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
"$py" - <<'PY' 2>&1 | tee -a "$out/gpu.txt"
import torch, transformers, megatron.core, mpi4py
from mpi4py import MPI
print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__,
      "megatron-core", megatron.core.__version__, "mpi4py", mpi4py.__version__)
print(MPI.Get_library_version().splitlines()[0])
PY
timeout 480 "$py" -m pytest tests/gpu -ra -q -p no:cacheprovider 2>&1 | tee "$out/gpu-tests.log"
tests=${PIPESTATUS[0]}
run=/tmp/yatt-demo-1gpu
rm -rf "$run"
sed 's/steps: 30/steps: 12/' configs/demo_1gpu.yaml > /tmp/demo_1gpu.yaml
timeout 300 "$py" -m yatt_hpc.cli run /tmp/demo_1gpu.yaml --run-dir "$run" 2>&1 | tee "$out/demo-1gpu.log"
demo=${PIPESTATUS[0]}
cp "$run/metrics.jsonl" "$out/" 2>/dev/null
cat "$run"/timeline/*.jsonl > "$out/timeline.jsonl" 2>/dev/null
tail -n 40 "$run"/logs/*.log > "$out/rank-logs.txt" 2>/dev/null
echo "gpu tests exit $tests, demo exit $demo" | tee -a "$out/gpu.txt"
[ "$tests" = 0 ] && [ "$demo" = 0 ]

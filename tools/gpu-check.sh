#!/usr/bin/env bash
# The GPU checks a CPU machine cannot run, in one command under ten minutes on one GPU:
#   bash tools/gpu-check.sh OUT_DIR [PYTHON]
# The versions, then tools/gpu_check.py: tests/gpu, the demo loop in fp32 and bf16 on one GPU, and
# SGLang inside the MPI world (generate, release/resume, weight sync, GenRM, abort, SIGTERM that
# saves); one `CHECK name: PASS|FAIL|SKIP detail` line each. Exit 0 only if no check FAILed.
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
# one line per check (CHECK name: PASS|FAIL|SKIP detail); logs under OUT_DIR/<check>/
timeout 560 "$py" tools/gpu_check.py "$out" 2>&1 | tee "$out/checks.txt"
exit ${PIPESTATUS[0]}

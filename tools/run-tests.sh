#!/usr/bin/env bash
# run-tests.sh — what `make test` runs: bring up the dev Slurm cluster when we can, run every
# test layer, and stop the cluster on exit if this script started it.
#   bash tools/run-tests.sh [pytest args]
# Slurm/MPI tests skip (with the reason) when no cluster can be had; with YATT_REQUIRE_SLURM=1
# and YATT_REQUIRE_MPI=1 (set by .ci/run) they fail instead.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${VENV:-.venv}/bin/python
started=0

cleanup() { [ "$started" = 1 ] && bash tools/slurm-dev-cluster.sh stop >/dev/null 2>&1; }
trap cleanup EXIT

if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  if ! bash tools/slurm-dev-cluster.sh status >/dev/null 2>&1; then
    bash tools/slurm-dev-cluster.sh start || { echo "dev Slurm cluster failed to start" >&2; [ "${YATT_REQUIRE_SLURM:-0}" = 1 ] && exit 1; }
    started=1
  fi
else
  echo "not root or no apt-get: not starting the dev Slurm cluster; Slurm tests will skip" >&2
fi

# lint first: seconds, and a CI run should not pass with code `make lint` rejects
${VENV:-.venv}/bin/ruff check yatt_hpc tests tools bench || exit 1
# the slowest tests at the end of the log: where the suite's time goes
"$PY" -m pytest -q --durations=25 "$@"

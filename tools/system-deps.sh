#!/usr/bin/env bash
# system-deps.sh — Open MPI + PMIx from Debian, for `mpirun` (make demo) without the Slurm cluster.
# Root installs directly; otherwise it says what to install. `tools/slurm-dev-cluster.sh start`
# installs these too.
set -euo pipefail
pkgs=(openmpi-bin libopenmpi-dev libpmix2)
if [ "$(id -u)" != 0 ]; then
  echo "mpirun not found: install Open MPI (as root: apt-get install ${pkgs[*]}), then re-run" >&2
  exit 1
fi
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >/dev/null
echo "installed ${pkgs[*]}"

#!/usr/bin/env bash
# Debian packages the tests and demo need: OpenMPI (Horovod's MPI controller, Adasum) and SLURM
# with munge (the srun launch test starts a one-node cluster with scripts/start-local-slurm.sh).
# Runs apt-get only for what is missing; needs root (CI runs as root).
set -euo pipefail
missing=()
command -v mpirun >/dev/null || missing+=(openmpi-bin)
command -v mpicc >/dev/null || missing+=(libopenmpi-dev)
command -v cmake >/dev/null || missing+=(cmake)
command -v g++ >/dev/null || missing+=(g++)
command -v srun >/dev/null || missing+=(slurm-client)
command -v slurmctld >/dev/null || missing+=(slurmctld)
command -v slurmd >/dev/null || missing+=(slurmd)
command -v munged >/dev/null || missing+=(munge)
{ command -v ip && command -v tc; } >/dev/null || missing+=(iproute2)
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "install-system-deps: missing ${missing[*]}; run: sudo apt-get install -y ${missing[*]}" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -q >/dev/null || true
apt-get install -y -q "${missing[@]}" >/dev/null
echo "install-system-deps: installed ${missing[*]}"

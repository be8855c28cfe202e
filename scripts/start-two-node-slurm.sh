#!/usr/bin/env bash
# Start a SLURM cluster of two real nodes on this machine: slurmd -N n1 and slurmd -N n2, each in its
# own network namespace (veth 10.78.0.1 / 10.78.0.2), slurmctld in n1's (lightning_dist.cluster.slurm_nodes).
# Needs root, iproute2, util-linux and Debian's slurmctld slurmd slurm-client munge (installed if missing).
# Prints the SLURM_CONF path; clients run inside n1: /tmp/ld_slurm_nodes/on-n1 srun -N2 --ntasks-per-node=1 ...
# `scripts/start-two-node-slurm.sh stop` stops it. Own config, state, ports (6917/6918) and ClusterName:
# it can run next to scripts/start-local-slurm.sh's one-node cluster.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if [ "${1:-}" = stop ]; then
  exec "$PY" -m lightning_dist.cluster.slurm_nodes down
fi
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurmctld slurmd slurm-client munge >/dev/null
fi
exec "$PY" -m lightning_dist.cluster.slurm_nodes up "$@"

#!/usr/bin/env bash
# Start a one-node SLURM cluster on this machine (for tests and trying the srun launch path).
# Needs root and Debian's slurmctld slurmd slurm-client munge (installed if missing).
# Prints the SLURM_CONF path to export; `scripts/start-local-slurm.sh stop` stops it.
set -euo pipefail
STATE=${LD_SLURM_DIR:-/tmp/lightning_dist_slurm}
if [ "${1:-}" = stop ]; then
  # by PID, from the daemons' own pid files (SlurmctldPidFile/SlurmdPidFile below), and only when that
  # PID is still this cluster's daemon (not a recycled one): nothing else is signalled
  for daemon in slurmctld slurmd; do
    pid=$(cat "$STATE/$daemon.pid" 2>/dev/null || true)
    [[ "$pid" =~ ^[0-9]+$ ]] || continue
    cmd=$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null || true)
    if [ "$(cat "/proc/$pid/comm" 2>/dev/null || true)" = "$daemon" ] && [[ "$cmd" == *"-f $STATE/"* ]]; then
      kill "$pid" 2>/dev/null || true
    fi
  done
  exit 0
fi
if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurmctld slurmd slurm-client munge >/dev/null
fi
mkdir -p "$STATE"/{state,spool,log}
cpus=$(nproc)
host=$(hostname)
cat >"$STATE/slurm.conf" <<CONF
ClusterName=lightning_dist
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$STATE/state
SlurmdSpoolDir=$STATE/spool
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd.log
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
ReturnToService=2
NodeName=$host CPUs=$cpus State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF
if ! pgrep -x munged >/dev/null; then
  mkdir -p /run/munge /var/log/munge /var/lib/munge /etc/munge
  [ -s /etc/munge/munge.key ] || dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
  chown -R munge:munge /run/munge /var/log/munge /var/lib/munge /etc/munge 2>/dev/null || true
  chmod 400 /etc/munge/munge.key
  su -s /bin/sh munge -c munged 2>/dev/null || munged --force
fi
export SLURM_CONF=$STATE/slurm.conf
# A controller started here begins with an empty state: jobs that a killed run left RUNNING in the
# saved state would be recovered and hold the node's CPUs, so every new job would wait forever.
if ! pgrep -f "slurmctld -f $STATE" >/dev/null; then
  rm -rf "$STATE/state" && mkdir -p "$STATE/state"
  slurmctld -f "$SLURM_CONF"
fi
if ! pgrep -f "slurmd -f $STATE" >/dev/null; then
  rm -rf "$STATE/spool" && mkdir -p "$STATE/spool"
  slurmd -f "$SLURM_CONF"
fi
for _ in $(seq 1 30); do
  if [ "$(sinfo -h -o %T 2>/dev/null)" = idle ]; then
    echo "SLURM_CONF=$SLURM_CONF"
    exit 0
  fi
  sleep 1
done
echo "start-local-slurm: the node is not idle after 30 s (jobs below hold it, or it did not come up);" \
  "stop it with '$0 stop' and rerun; logs in $STATE/log" >&2
sinfo >&2 || true
squeue >&2 || true
exit 1

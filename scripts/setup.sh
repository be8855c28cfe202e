#!/usr/bin/env bash
# `make setup`: the project's virtualenv with everything the demo and the tests need, one line per
# step with the elapsed time. Steps: system packages (apt-get, as root only), the venv, torch (the
# CPU build first, so nothing pulls a CUDA one), the package with its dev/notebook/ft extras, Horovod.
#
# Without root the system packages are not installed: the step says which are missing and the rest
# still installs (the pack itself needs none of them; Horovod needs MPI + a compiler, the SLURM and
# emulated-node tests need slurm, munge and iproute2).
#
# Usage: VENV=.venv TORCH_SPEC=torch==2.13.0 scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
PY="$VENV/bin/python"
start=$(date +%s)
step() { printf 'setup [%4d s] %s\n' "$(( $(date +%s) - start ))" "$*"; }
root=1
[ "$(id -u)" = 0 ] || root=0

step "system packages: OpenMPI, cmake, g++ (Horovod), SLURM + munge, iproute2 (system tests)"
if ! scripts/install-system-deps.sh; then
  if [ "$root" = 1 ]; then exit 1; fi
  step "  not root: skipped (the pack installs without them; the tests that need them will fail or skip)"
fi
step "virtualenv $VENV"
test -x "$PY" || python3 -m venv "$VENV"
"$PY" -m pip install -q --upgrade pip
step "torch ($TORCH_SPEC)"
"$PY" -m pip install -q "$TORCH_SPEC"
step "lightning-dist with its dev, notebook and ft (torchft) extras (pip install -e)"
"$PY" -m pip install -q -e ".[dev,notebooks,horovod-build,ft]"
step "Horovod (lightning-dist install-horovod: a few minutes the first time, then from its wheel cache)"
if ! "$PY" -m lightning_dist.install_horovod; then
  if [ "$root" = 1 ]; then exit 1; fi
  step "  Horovod not built (see above); Horovod() and HorovodAdasum() need it, every other strategy works"
fi
step "done"

#!/usr/bin/env bash
# Build and install horovod 0.28.1 against the torch already installed in $PYTHON (default python3).
#
# A thin wrapper: the build lives in lightning_dist/install_horovod.py, which is also
# `lightning-dist install-horovod` (see --help for the options: --cuda, --without-mpi, --jobs,
# --cache-dir, --dry-run, --force). Nothing to do, fast, when horovod already imports for this torch.
#
# Usage: PYTHON=.venv/bin/python scripts/install-horovod.sh [options]
#        HOROVOD_SDIST=horovod-0.28.1.tar.gz scripts/install-horovod.sh   (offline: build from a local sdist)
# Needs: a C++ compiler, cmake, OpenMPI for Adasum (apt-get install -y libopenmpi-dev openmpi-bin g++ cmake).
set -euo pipefail

# from a checkout, the module is importable even before `pip install -e .`
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" -m lightning_dist.install_horovod "$@"

#!/usr/bin/env bash
# Build and install horovod 0.28.1 against the torch already installed in the active Python.
#
# Horovod's last release compiles with -std=c++14, which current torch headers reject (they need
# C++17), so the build goes through a compiler wrapper that rewrites the standard to
# C++17. With CUDA present it also builds NCCL operations. The built wheel is cached, keyed by the
# torch version, so a second run only reinstalls it.
#
# Usage: scripts/install-horovod.sh            (uses `python` on PATH, e.g. the project venv)
#        PYTHON=/path/to/python scripts/install-horovod.sh
#        HOROVOD_SDIST=horovod-0.28.1.tar.gz scripts/install-horovod.sh   (offline: build from a local sdist)
# Needs: a C++ compiler, cmake, OpenMPI (Debian: apt-get install -y libopenmpi-dev openmpi-bin).
set -euo pipefail

PYTHON=${PYTHON:-python}
HOROVOD_VERSION=${HOROVOD_VERSION:-0.28.1}
CACHE_DIR=${LIGHTNING_DIST_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/lightning_dist/wheels}

torch_tag=$("$PYTHON" -c 'import torch; print(torch.__version__.replace("+", "_"))') || {
  echo "install-horovod: torch is not importable by $PYTHON; install torch first (pip install torch==2.13.0)" >&2
  exit 1
}
has_cuda=$("$PYTHON" -c 'import torch; print(int(torch.cuda.is_available()))')
wheel_dir="$CACHE_DIR/horovod-$HOROVOD_VERSION-torch-$torch_tag-cuda$has_cuda"

if "$PYTHON" -c "import horovod.torch, sys; sys.exit(0 if horovod.__version__ == '$HOROVOD_VERSION' else 1)" 2>/dev/null; then
  echo "install-horovod: horovod $HOROVOD_VERSION already importable"
  exit 0
fi

build_deps=(numpy packaging psutil yaml cloudpickle cffi pycparser)
missing=()
for mod in "${build_deps[@]}"; do
  "$PYTHON" -c "import $mod" 2>/dev/null || missing+=("$([ "$mod" = yaml ] && echo pyyaml || echo "$mod")")
done
if [ ${#missing[@]} -gt 0 ]; then
  "$PYTHON" -m pip install -q "${missing[@]}"
fi

if ! ls "$wheel_dir"/horovod-*.whl >/dev/null 2>&1; then
  command -v mpicc >/dev/null || {
    echo "install-horovod: mpicc not found; install OpenMPI first (apt-get install -y libopenmpi-dev openmpi-bin)" >&2
    exit 1
  }
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  real_cxx=$(command -v "${CXX:-g++}")
  extra_includes=""
  if [ "$has_cuda" = 1 ]; then
    extra_includes="-include string -include stdexcept -include cstdint"
  fi
  cat >"$work/cxx" <<WRAP
#!/usr/bin/env bash
args=()
for a in "\$@"; do
  case "\$a" in
    -std=c++11|-std=c++14|-std=gnu++11|-std=gnu++14) args+=(-std=c++17) ;;
    *) args+=("\$a") ;;
  esac
done
exec "$real_cxx" $extra_includes "\${args[@]}"
WRAP
  chmod +x "$work/cxx"

  export CXX="$work/cxx"
  export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1
  export HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1
  export CMAKE_POLICY_VERSION_MINIMUM=3.5
  export MAKEFLAGS="-j$(nproc)"
  if [ "$has_cuda" = 1 ]; then
    export HOROVOD_GPU_OPERATIONS=NCCL
    export HOROVOD_BUILD_CUDA_CC_LIST=${HOROVOD_BUILD_CUDA_CC_LIST:-$("$PYTHON" -c 'import torch; a,b=torch.cuda.get_device_capability(); print(f"{a}{b}")')}
    if [ -z "${HOROVOD_NCCL_HOME:-}" ]; then
      nccl_pkg=$("$PYTHON" -c 'import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__))' 2>/dev/null \
        || "$PYTHON" -c 'import nvidia.nccl, os; print(list(nvidia.nccl.__path__)[0])')
      mkdir -p "$work/nccl/lib"
      ln -s "$nccl_pkg/include" "$work/nccl/include"
      ln -s "$nccl_pkg/lib/libnccl.so.2" "$work/nccl/lib/libnccl.so"
      export HOROVOD_NCCL_HOME="$work/nccl"
    fi
  fi
  echo "install-horovod: building horovod $HOROVOD_VERSION for torch $torch_tag (cuda=$has_cuda); a few minutes"
  mkdir -p "$wheel_dir"
  "$PYTHON" -m pip wheel -q --no-build-isolation --no-deps --no-binary horovod \
    "${HOROVOD_SDIST:-horovod==$HOROVOD_VERSION}" -w "$work/out"
  mv "$work"/out/horovod-*.whl "$wheel_dir/"
fi

"$PYTHON" -m pip install -q --no-deps --force-reinstall "$wheel_dir"/horovod-*.whl
echo "install-horovod: installed $(ls "$wheel_dir"/horovod-*.whl)"

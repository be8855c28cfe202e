#!/usr/bin/env bash
# One prepared run of every GPU check, for the device machine (one H200; see README "GPU checks").
# Carry: .whl/ holding horovod-0.28.1.tar.gz (pip download --no-deps --no-binary :all: horovod==0.28.1 -d .whl)
# and, for the offline build there, .whl/deps/ with its build wheels for the device's Python (3.12):
#   pip download --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#     --platform manylinux_2_17_x86_64 --implementation cp -d .whl/deps cffi pycparser cloudpickle psutil pyyaml packaging numpy cmake
# Writes logs under ${OUT:-/tmp/gpu-check}. Each step is time-limited; a failure does not stop the others.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
PY=${PYTHON:-python3}
export PATH=$(dirname "$(command -v "$PY")"):$PATH   # horovodrun and a pip-installed cmake
if [ -d .whl/deps ]; then export PIP_NO_INDEX=1 PIP_FIND_LINKS=$PWD/.whl/deps; fi   # no internet there
step() { local name=$1 limit=$2; shift 2; echo "=== $name"; timeout "$limit" "$@" >"$OUT/$name.log" 2>&1; echo "=== $name rc=$?"; tail -n 25 "$OUT/$name.log"; }

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
$PY -c 'import torch, lightning; print(torch.__version__, torch.version.cuda, lightning.__version__)'
# 1. DDP() at world size 1 over NCCL on the GPU, bf16-mixed (the embedded workload)
step ddp_nccl 240 $PY examples/train.py --strategy ld_ddp --accelerator gpu --devices 1 --max-steps 30 --precision bf16-mixed
# 2. collectives with CUDA tensors: NCCL at world size 1, Gloo with 2 ranks on the one GPU (NCCL refuses that)
step collectives_nccl 120 $PY -m torch.distributed.run --nproc_per_node 1 scripts/gpu_collectives_check.py --backend nccl
step collectives_gloo2 120 $PY -m torch.distributed.run --nproc_per_node 2 scripts/gpu_collectives_check.py --backend gloo
# 3. Compressed strategies on the GPU, one step each
for c in ${GPU_CHECK_COMPRESSORS:-fp16 int8 powersgd demo}; do
  step "compressed_$c" 180 $PY examples/train.py --strategy "compressed_$c" --accelerator gpu --devices 1 --max-steps 10 --precision bf16-mixed
done
# 4. Elastic at world size 1 over NCCL under torchrun: commits, is SIGKILLed, resumes with the fault-free weights
step elastic_nccl 300 $PY scripts/gpu_elastic_check.py "$OUT/elastic"
# 4b. DiLoCo at world size 1 over NCCL (syncs every 4 steps, int8 pseudo-gradients, bf16-mixed)
step diloco_nccl 240 $PY examples/train.py --strategy "lightning_dist:DiLoCo(inner_steps=4, compression='int8')" --accelerator gpu --devices 1 --max-steps 12 --precision bf16-mixed
# 5. Horovod with NCCL, then HorovodAdasum training on the GPU (1 rank, MPI controller)
sdist=$(ls .whl/horovod-*.tar.gz 2>/dev/null | head -1)
if [ -n "$sdist" ]; then
  command -v cmake >/dev/null || $PY -m pip install -q cmake
  step horovod_build ${GPU_CHECK_HOROVOD_BUILD_S:-420} env PYTHON=$PY HOROVOD_SDIST="$sdist" scripts/install-horovod.sh
  step horovod_check 60 horovodrun --check-build
  step horovod_adasum_gpu 240 mpirun -np 1 --allow-run-as-root -x PYTHONPATH $PY examples/train.py --strategy ld_horovod_adasum --accelerator gpu --devices 1 --max-steps 10
fi
# 6. one-GPU overhead of the compressors against no hook (GPT-2-small: 12 layers, d=768, batch 16 x 512,
#    bf16-mixed); GPU_CHECK_OVERHEAD=0 skips it
if [ "${GPU_CHECK_OVERHEAD:-1}" = 1 ]; then
  step gpu_overhead 600 $PY benchmarks/bench_gpu_overhead.py
fi

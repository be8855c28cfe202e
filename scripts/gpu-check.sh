#!/usr/bin/env bash
# One prepared run of every GPU check, for the device machine (one H200; docs/gpu-checks.md).
#
#   scripts/gpu-check.sh            # on the GPU machine: writes logs and results under ${OUT:-/tmp/gpu-check}
#   scripts/gpu-check.sh --dry-run  # here, on CPU first: the same steps' plumbing (files, imports,
#                                   # commands, tiny CPU runs) so no GPU time goes on a typo
#
# Budget: the device machine gives 15 minutes in all, start-up included. Steps run most valuable
# first and stop starting new ones after GPU_CHECK_BUDGET_S (default 540 s), so a rerun still fits.
# Carry: .whl/ holding horovod-0.28.1.tar.gz (pip download --no-deps --no-binary :all: horovod==0.28.1 -d .whl)
# and, for the offline machine, .whl/deps/ with wheels for its Python (3.12): Horovod's build
# dependencies and the notebook runner's:
#   pip download --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#     --platform manylinux_2_17_x86_64 --implementation cp -d .whl/deps cffi pycparser cloudpickle \
#     psutil pyyaml packaging numpy cmake nbclient nbformat ipykernel matplotlib
# Each step is time-limited; a failure does not stop the others. Exit status: the number of failed steps.
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
PY=${PYTHON:-python3}
export PATH=$(dirname "$(command -v "$PY")"):$PATH   # horovodrun and a pip-installed cmake
if [ -d .whl/deps ]; then export PIP_NO_INDEX=1 PIP_FIND_LINKS=$PWD/.whl/deps; fi   # no internet there
BUDGET=${GPU_CHECK_BUDGET_S:-540}
START=$(date +%s)
FAILED=0
if [ "$DRY" = 1 ]; then
  ACC=cpu DEV=2 PREC=32-true STEPS=2
else
  ACC=gpu DEV=1 PREC=bf16-mixed STEPS=0
fi
steps() { [ "$STEPS" = 0 ] && echo "$1" || echo "$STEPS"; }   # a dry run trains 2 steps

step() {
  local name=$1 limit=$2; shift 2
  local elapsed=$(( $(date +%s) - START ))
  if [ "$elapsed" -ge "$BUDGET" ]; then echo "=== $name skipped: ${elapsed}s spent of the ${BUDGET}s budget"; return; fi
  [ "$DRY" = 1 ] && limit=$(( limit < 180 ? limit : 180 ))
  echo "=== $name (at ${elapsed}s, limit ${limit}s)"
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "=== $name rc=$rc ($(( $(date +%s) - START ))s)"
  tail -n 25 "$OUT/$name.log"
  [ "$rc" = 0 ] || FAILED=$((FAILED + 1))
}

if [ "$DRY" = 1 ]; then
  echo "gpu-check --dry-run: CPU plumbing only, nothing here is a GPU figure"
  for f in scripts/gpu_collectives_check.py scripts/gpu_elastic_check.py scripts/execute-notebooks.py \
           benchmarks/bench_gpu_overhead.py examples/train.py examples/quickstart.py; do
    [ -f "$f" ] || { echo "missing: $f"; FAILED=$((FAILED + 1)); }
  done
else
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
fi
$PY -c 'import torch, lightning, lightning_dist; print(torch.__version__, torch.version.cuda, lightning.__version__, lightning_dist.__version__)'

# 1. the four notebooks on every GPU of the box (fork launch from a kernel); a CUDA initialisation
#    before a fork names its caller in the error (lightning_dist.fork_safety)
if [ "$DRY" = 1 ]; then
  step notebooks_plumbing 60 $PY scripts/execute-notebooks.py --help
else
  mkdir -p "$OUT/notebooks"
  step notebooks 300 env LD_FIGURES_DIR="$OUT/notebooks" $PY scripts/execute-notebooks.py
  cp notebooks/*.ipynb "$OUT/notebooks/" 2>/dev/null
fi
# 2. the compressors' overhead on one GPU against torch's hooks (GPT-2-small, bf16-mixed, every row)
if [ "$DRY" = 1 ]; then
  step gpu_overhead 180 $PY benchmarks/bench_gpu_overhead.py --smoke --steps 2 --warmup 1
else
  step gpu_overhead 330 $PY benchmarks/bench_gpu_overhead.py
fi
# 3. DDP() over NCCL, bf16-mixed (the embedded workload)
step ddp 180 $PY examples/train.py --strategy ld_ddp --accelerator $ACC --devices $DEV --max-steps "$(steps 30)" --precision $PREC
# 4. collectives with CUDA tensors: NCCL at world size 1, Gloo with 2 ranks on the one GPU (NCCL refuses that)
if [ "$DRY" = 0 ]; then
  step collectives_nccl 120 $PY -m torch.distributed.run --nproc_per_node 1 scripts/gpu_collectives_check.py --backend nccl
  step collectives_gloo2 120 $PY -m torch.distributed.run --nproc_per_node 2 scripts/gpu_collectives_check.py --backend gloo
fi
# 5. Compressed strategies and DiLoCo, a few steps each
for c in ${GPU_CHECK_COMPRESSORS:-fp16 int8 powersgd demo}; do
  step "compressed_$c" 150 $PY examples/train.py --strategy "ld_compressed_$c" --accelerator $ACC --devices $DEV --max-steps "$(steps 10)" --precision $PREC
done
step diloco 180 $PY examples/train.py --strategy "lightning_dist:DiLoCo(inner_steps=4, compression='int8')" --accelerator $ACC --devices $DEV --max-steps "$(steps 12)" --precision $PREC
# 5b. Sharded (FSDP2): int8 reduce-scatter and DiLoCo over shards, NCCL at world size 1, bf16-mixed
step sharded_int8 180 $PY examples/train.py --strategy ld_sharded_int8 --accelerator $ACC --devices $DEV --max-steps "$(steps 10)" --precision $PREC
step sharded_diloco 180 $PY examples/train.py --strategy "lightning_dist:ShardedDiLoCo(inner_steps=4, compression='int8')" --accelerator $ACC --devices $DEV --max-steps "$(steps 12)" --precision $PREC
# 5c. Sharded against Lightning's FSDP2 (ModelParallelStrategy), the same step as bench_sharded (issue 40):
#     world size 1 (NCCL) and 2 ranks on the one GPU (Gloo with CUDA tensors); step-time ratios in one run
if [ "$DRY" = 1 ]; then
  step sharded_vs_fsdp2 180 $PY benchmarks/bench_sharded.py --accelerator cpu --ranks 2 --rounds 1 --steps 2 --warmup 1 --rows fsdp2 sharded --out "$OUT/sharded_vs_fsdp2"
else
  for n in 1 2; do
    step "sharded_vs_fsdp2_$n" 150 $PY benchmarks/bench_sharded.py --accelerator gpu --ranks $n --rounds 1 --steps 20 --rows fsdp2 sharded sharded_int8 --out "$OUT/sharded_vs_fsdp2_$n"
  done
fi
# 6. Elastic over NCCL under torchrun: commits, is SIGKILLed, resumes with the fault-free weights
[ "$DRY" = 0 ] && step elastic_nccl 240 $PY scripts/gpu_elastic_check.py "$OUT/elastic"
# 7. Horovod built with NCCL, then HorovodAdasum on the GPU (1 rank, MPI controller)
sdist=$(ls .whl/horovod-*.tar.gz 2>/dev/null | head -1)
if [ "$DRY" = 1 ]; then
  step horovod_plan 60 env HOROVOD_SDIST="${sdist:-horovod-0.28.1.tar.gz}" $PY -m lightning_dist.install_horovod --dry-run --cuda auto
elif [ -n "$sdist" ]; then
  command -v cmake >/dev/null || $PY -m pip install -q cmake
  step horovod_build ${GPU_CHECK_HOROVOD_BUILD_S:-300} env HOROVOD_SDIST="$sdist" $PY -m lightning_dist.install_horovod --cuda on
  step horovod_check 60 horovodrun --check-build
  step horovod_adasum_gpu 180 mpirun -np 1 --allow-run-as-root -x PYTHONPATH $PY examples/train.py --strategy ld_horovod_adasum --accelerator gpu --devices 1 --max-steps 10
fi
echo "gpu-check: $FAILED step(s) failed, $(( $(date +%s) - START ))s"
exit "$FAILED"

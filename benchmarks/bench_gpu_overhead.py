"""Compute overhead of gradient compression on one GPU: step time against no comm hook.

    python benchmarks/bench_gpu_overhead.py [--steps 30] [--warmup 10] [--rows fp16,int8]

The anchor setup: a GPT-2-small-sized causal transformer (12 layers, d=768, 12 heads,
vocab 50257, tied embeddings, 124M parameters), batch 16 x 512 tokens of random ids, bf16-mixed,
fused AdamW, Lightning ``Trainer(devices=1)`` with a DDP strategy at world size 1 over NCCL, median
step time of ``--steps`` steps after ``--warmup`` warm-up steps. Each row runs in a fresh process.

At world size 1 nothing crosses a wire: ``lightning_dist.collectives`` short-cuts every collective,
so a Compressed row costs exactly its compressor's compute (compress, decompress, error feedback),
while torch's hooks still make their NCCL calls. Every row uses fused AdamW (DeMo is meant for SGD;
the optimizer does not change the hook's cost). Targets: fp16 <= +3%, int8 <= +5%, PowerSGD rank 4
<= +15% over no hook (torch's PowerSGD hook measured about +120% on one H200 in this setup).

Without CUDA it exits with a message; ``--smoke`` runs a tiny model on CPU (Gloo) to check the
script itself, which measures nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Any

ROWS: dict[str, str] = {
    "none": "no comm hook (Lightning DDPStrategy)",
    "ld_ddp": "lightning_dist DDP() (collectives hook)",
    "fp16": "Compressed fp16",
    "int8": "Compressed int8",
    "powersgd": "Compressed powersgd rank 4",
    "demo": "Compressed demo",
    "torch_fp16": "torch fp16_compress_hook",
    "torch_powersgd": "torch powerSGD_hook rank 4",
}
TARGETS = {"fp16": 1.03, "int8": 1.05, "powersgd": 1.15}


# -- the worker: one row in this process ----------------------------------------------------------
def build_model(smoke: bool) -> Any:
    import lightning as L
    import torch
    import torch.nn.functional as F
    from torch import nn

    vocab, d, layers, heads, block = (512, 64, 2, 4, 64) if smoke else (50257, 768, 12, 12, 512)

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1 = nn.LayerNorm(d)
            self.qkv = nn.Linear(d, 3 * d)
            self.proj = nn.Linear(d, d)
            self.ln2 = nn.LayerNorm(d)
            self.fc = nn.Linear(d, 4 * d)
            self.out = nn.Linear(4 * d, d)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, c = x.shape
            q, k, v = (
                z.view(b, t, heads, c // heads).transpose(1, 2) for z in self.qkv(self.ln1(x)).split(c, 2)
            )
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
            return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))

    class GPT(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.wte = nn.Embedding(vocab, d)
            self.wpe = nn.Embedding(block, d)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln_f = nn.LayerNorm(d)
            self.head = nn.Linear(d, vocab, bias=False)
            self.head.weight = self.wte.weight

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
            for blk in self.blocks:
                x = blk(x)
            return self.head(self.ln_f(x))

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            logits = self(batch[:, :-1])
            return F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=6e-4, weight_decay=0.1, fused=not smoke)

    return GPT(), vocab, block


def make_strategy(row: str) -> Any:
    from lightning.pytorch.strategies import DDPStrategy
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    from lightning_dist import DDP, Compressed

    if row == "none":
        return DDPStrategy()
    if row == "ld_ddp":
        return DDP()
    if row == "torch_fp16":
        return DDPStrategy(ddp_comm_hook=default_hooks.fp16_compress_hook)
    if row == "torch_powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=2
        )
        return DDPStrategy(ddp_comm_state=state, ddp_comm_hook=powerSGD_hook.powerSGD_hook)
    options = {"rank": 4, "warmup": 0} if row == "powersgd" else {}  # compressed from step 0
    return Compressed(row, log_stats=False, **options)


def worker(row: str, a: argparse.Namespace) -> dict[str, Any]:
    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    from lightning_dist.workload.trainer import quiet_trainer

    torch.manual_seed(0)
    if not a.smoke:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    model, vocab, block = build_model(a.smoke)
    batch = 2 if a.smoke else 16
    steps = a.warmup + a.steps
    data = torch.randint(0, vocab, (steps * batch, block + 1), generator=torch.Generator().manual_seed(0))
    times: list[float] = []
    cuda = not a.smoke

    class Timer(L.Callback):
        def on_train_batch_start(self, *_: Any) -> None:
            if cuda:
                torch.cuda.synchronize()
            self.start = time.perf_counter()

        def on_train_batch_end(self, *_: Any) -> None:
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - self.start)

    trainer = quiet_trainer(
        accelerator="cpu" if a.smoke else "gpu",
        devices=1,
        strategy=make_strategy(row),
        precision="bf16-mixed",
        max_steps=steps,
        limit_val_batches=0,
        callbacks=[Timer()],
    )
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer.fit(model, DataLoader(data, batch_size=batch, shuffle=False, drop_last=True))
    measured = times[a.warmup :]
    median = statistics.median(measured)
    return {
        "row": row,
        "median_s": median,
        "tokens_per_s": batch * block / median,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan"),
        "params": sum(p.numel() for p in model.parameters()),
        "steps": len(measured),
    }


# -- the driver: one process per row, then the table -------------------------------------------------
def run_row(row: str, a: argparse.Namespace) -> dict[str, Any]:
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--worker",
        row,
        "--steps",
        str(a.steps),
        "--warmup",
        str(a.warmup),
    ]
    if a.smoke:
        cmd.append("--smoke")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=a.timeout)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    return {"row": row, "error": f"exit {proc.returncode}: {(proc.stderr or proc.stdout)[-1500:]}"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated subset of {', '.join(ROWS)}")
    p.add_argument("--timeout", type=float, default=900, help="seconds per row")
    p.add_argument(
        "--smoke", action="store_true", help="tiny model on CPU: checks the script, measures nothing"
    )
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        print("RESULT " + json.dumps(worker(a.worker, a)), flush=True)
        return

    import torch

    if not a.smoke and not torch.cuda.is_available():
        sys.exit(
            "bench_gpu_overhead.py needs a CUDA GPU and found none "
            f"(torch {torch.__version__}, CUDA build {torch.version.cuda}); "
            "run it on a GPU machine, or pass --smoke to check the script on CPU"
        )
    rows = [r for r in a.rows.split(",") if r]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        sys.exit(f"--rows: unknown {', '.join(unknown)}; accepted: {', '.join(ROWS)}")
    if "none" not in rows:
        rows.insert(0, "none")
    results = {}
    for row in rows:
        print(f"[bench] {ROWS[row]} ...", flush=True)
        results[row] = run_row(row, a)
        if "error" in results[row]:
            print(f"[bench] {ROWS[row]} FAILED\n{results[row]['error']}", flush=True)

    device = "CPU (smoke test, not a measurement)" if a.smoke else torch.cuda.get_device_name(0)
    print()
    print(f"machine: {device}, {platform.machine()}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    print(f"command: python benchmarks/bench_gpu_overhead.py {' '.join(sys.argv[1:])}".rstrip())
    base = results["none"].get("median_s", math.nan)
    params = next((r["params"] for r in results.values() if "params" in r), 0)
    print(
        f"model: {params / 1e6:.1f}M parameters, bf16-mixed, fused AdamW, world size 1; "
        f"median of {a.steps} steps after {a.warmup} warm-up"
    )
    print()
    print("| configuration | median step | tokens/s | peak memory | vs no hook | target |")
    print("|---|---:|---:|---:|---:|---:|")
    for row in rows:
        r = results[row]
        if "error" in r:
            print(f"| {ROWS[row]} | failed | | | | |")
            continue
        target = f"<= {TARGETS[row]:.2f}x" if row in TARGETS else ""
        print(
            f"| {ROWS[row]} | {r['median_s'] * 1e3:.1f} ms | {r['tokens_per_s'] / 1e3:.1f}k | "
            f"{r['peak_gib']:.1f} GiB | {r['median_s'] / base:.3f}x | {target} |"
        )
    for ours, theirs in (("fp16", "torch_fp16"), ("powersgd", "torch_powersgd")):
        if "median_s" in results.get(ours, {}) and "median_s" in results.get(theirs, {}):
            extra_ours = results[ours]["median_s"] - base
            extra_theirs = results[theirs]["median_s"] - base
            print(
                f"{ROWS[ours]} vs {ROWS[theirs]}: {results[ours]['median_s'] / results[theirs]['median_s']:.3f}x "
                f"step time; overhead {extra_ours * 1e3:+.1f} ms vs {extra_theirs * 1e3:+.1f} ms"
            )
    if any("error" in r for r in results.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()

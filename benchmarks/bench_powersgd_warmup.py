"""PowerSGD's warm-up on Lightning's demo Transformer with AdamW: ``DDP()``, ``Compressed("powersgd")``
with its defaults (``warmup="auto"``: the first 10% of the steps uncompressed) and with ``warmup=0``.

    python benchmarks/bench_powersgd_warmup.py                 # 20 steps, 2 CPU processes
    python benchmarks/bench_powersgd_warmup.py --steps 60 --lr 1e-3

The model is Lightning's ``lightning.pytorch.demos.Transformer`` (code nobody here wrote), trained as
its ``LightningTransformer`` trains it but with AdamW; the data is ``WikiText2``'s reader on a
word-level text file made from the running Python's standard library (``WikiText2`` itself downloads
its file), so every machine has it. Each row is one launch of 2 processes with the same seed and data;
the table gives each row's final and last-5-step mean train loss (rank 0).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Any

ROWS = {
    "ddp": ("DDP()", {}),
    "powersgd": ('Compressed("powersgd") (defaults: warmup="auto")', {"compressor": "powersgd"}),
    "powersgd_warmup0": ('Compressed("powersgd", warmup=0)', {"compressor": "powersgd", "warmup": 0}),
}


def write_corpus(path: Path, nbytes: int) -> None:
    """The first ``nbytes`` of the standard library's top-level modules, as WikiText2's text file."""
    texts, total = [], 0
    for name in sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py"))):
        with open(name, encoding="utf8", errors="ignore") as fh:
            texts.append(fh.read())
        total += len(texts[-1])
        if total > nbytes:
            break
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(texts)[:nbytes], encoding="utf8")


def train(a: argparse.Namespace) -> None:
    """One row, in each of the 2 processes Lightning starts."""
    import lightning as L
    import torch
    from lightning.pytorch.demos import Transformer, WikiText2
    from torch.utils.data import DataLoader

    import lightning_dist
    from lightning_dist.workload.trainer import quiet_trainer

    class Module(L.LightningModule):
        def __init__(self, vocab_size: int) -> None:
            super().__init__()
            self.model = Transformer(vocab_size=vocab_size)
            self.losses: list[float] = []

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            inputs, target = batch
            loss = torch.nn.functional.nll_loss(self.model(inputs, target), target.view(-1))
            self.losses.append(float(loss.detach()))
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=a.lr)

    torch.set_num_threads(1)
    L.seed_everything(42, verbose=False)
    data = WikiText2(Path(a.data), download=False)
    _, options = ROWS[a.row]
    strategy = lightning_dist.Compressed(**options) if options else lightning_dist.DDP()
    module = Module(data.vocab_size)
    trainer = quiet_trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=a.steps)
    trainer.fit(module, DataLoader(data, batch_size=a.batch_size, shuffle=True))
    if trainer.global_rank == 0:
        tail = module.losses[-5:]
        result = {"final": module.losses[-1], "tail5": sum(tail) / len(tail), "vocab": data.vocab_size}
        result["warmup_steps"] = getattr(trainer.strategy, "warmup_steps", 0)
        Path(a.out).write_text(json.dumps(result))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--batch-size", type=int, default=20, help="sequences of 35 words per rank and step")
    p.add_argument("--corpus-bytes", type=int, default=400_000)
    p.add_argument("--row", choices=ROWS, help="(internal) train one row")
    p.add_argument("--data", help="(internal) the folder of wikitext-2.txt")
    p.add_argument("--out", help="(internal) where rank 0 writes its row")
    a = p.parse_args()
    if a.row:
        train(a)
        return
    work = Path(tempfile.mkdtemp(prefix="bench_powersgd_warmup_"))
    write_corpus(work / "wikitext-2.txt", a.corpus_bytes)
    results = {}
    for row in ROWS:
        out = work / f"{row}.json"
        argv = [sys.executable, __file__, "--row", row, "--data", str(work), "--out", str(out)]
        argv += ["--steps", str(a.steps), "--lr", str(a.lr), "--batch-size", str(a.batch_size)]
        subprocess.run(argv, check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        results[row] = json.loads(out.read_text())
    vocab = results["ddp"]["vocab"]
    print(f"Lightning's demo Transformer, AdamW lr {a.lr}, {a.steps} steps, 2 CPU processes, vocab {vocab}")
    print(f"| {'strategy':<50} | warm-up | final loss | last 5 steps | vs DDP (last 5) |")
    print(f"|{'-' * 52}|---------|------------|--------------|-----------------|")
    for row, (label, _) in ROWS.items():
        r = results[row]
        gap = r["tail5"] - results["ddp"]["tail5"]
        print(
            f"| {label:<50} | {r['warmup_steps']:>7} | {r['final']:>10.4f} | {r['tail5']:>12.4f} | {gap:>+15.4f} |"
        )


if __name__ == "__main__":
    main()

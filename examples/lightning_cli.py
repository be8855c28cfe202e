"""The quickstart model under Lightning's own command line (LightningCLI), strategy from a flag or YAML.

    python examples/lightning_cli.py fit --config examples/lightning_cli.yaml
    python examples/lightning_cli.py fit --config examples/lightning_cli.yaml --trainer.strategy ld_ddp
    python examples/lightning_cli.py fit --trainer.strategy ld_compressed_int8 --trainer.devices 2
    python examples/lightning_cli.py fit --print_config                      # every option, as YAML
    torchrun --nproc-per-node 8 examples/lightning_cli.py fit --config examples/lightning_cli.yaml \\
        --trainer.accelerator gpu --trainer.devices 8

Every registered name (`lightning-dist strategies`) works as `--trainer.strategy`; a strategy with
options goes in the YAML as `class_path: lightning_dist.Compressed` with `init_args` (see the file).
Needs `pip install "jsonargparse[signatures]"` (the `examples` extra).
"""

from __future__ import annotations

import lightning as L
from lightning.pytorch.cli import LightningCLI
from quickstart import Classifier, make_data
from torch.utils.data import DataLoader

import lightning_dist  # noqa: F401  (registers the ld_* strategy names)


class SyntheticData(L.LightningDataModule):
    """The quickstart's synthetic classification task as a DataModule."""

    def __init__(self, samples: int = 4096, batch_size: int = 64, seed: int = 0) -> None:
        super().__init__()
        self.samples, self.batch_size, self.seed = samples, batch_size, seed

    def train_dataloader(self) -> DataLoader:
        return DataLoader(make_data(self.samples, seed=self.seed), batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(make_data(self.samples // 4, seed=self.seed + 1), batch_size=self.batch_size)


def main(argv: list[str] | None = None) -> None:
    """``argv``: the command line's arguments (None: ``sys.argv``'s)."""
    LightningCLI(Classifier, SyntheticData, seed_everything_default=0, save_config_callback=None, args=argv)


if __name__ == "__main__":
    main()

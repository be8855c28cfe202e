"""What a test script leaves for its test: each rank's final weights (``rank{r}.pt``) and facts (``rank{r}.json``)."""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from torch import nn


def save_rank(out: str, rank: int, model: nn.Module, info: dict[str, Any], prefix: str = "") -> None:
    os.makedirs(out, exist_ok=True)
    weights = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    torch.save(weights, os.path.join(out, f"{prefix}rank{rank}.pt"))
    with open(os.path.join(out, f"{prefix}rank{rank}.json"), "w") as fh:
        json.dump(info, fh)

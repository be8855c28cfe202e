"""``ElasticDiLoCo``: DiLoCo under torchrun's elastic agent, resuming from commits.

The same machinery as ``Elastic`` (``ElasticMixin`` and its resilience part) over ``DiLoCo`` (no
gradient all-reduce; an outer Nesterov step every ``inner_steps`` optimizer steps): its commits also
hold DiLoCo's entry (every rank's weights, inner optimizer and compressor state, the last-sync
parameters, the outer momentum and the inner-step counter), so a run resumed at the same world size
continues bitwise; at another world size every rank restarts from the last-sync parameters with rank
0's inner optimizer state (DiLoCo's fallback, with a warning).
"""

from __future__ import annotations

import os
from typing import Any, Optional, Union

from typing_extensions import override

from lightning_dist.strategies.diloco import DiLoCo
from lightning_dist.strategies.elastic import ELASTIC_OPTIONS, ElasticMixin
from lightning_dist.strategies.options import options_from
from lightning_dist.strategies.options_resilience import ElasticOptions


class ElasticDiLoCo(ElasticMixin, DiLoCo):
    """DiLoCo under torchrun's elastic agent, resuming from commits (see the module docstring).

        torchrun --nproc-per-node=2 --max-restarts=3 ... train.py   # strategy=ElasticDiLoCo(inner_steps=100)

    Args:
        commit_every, keep, dirpath, seed, on_indivisible, scale_lr, background_commits: as
            ``Elastic``'s. A commit may fall inside a DiLoCo period: it holds every rank's weights and
            inner optimizer state, so the resumed run continues exactly where the commit was taken.
        **options: ``DiLoCo``'s (``inner_steps``, ``outer_lr``, ``outer_momentum``, ``nesterov``,
            ``compression``, ``sync_buffers``, and the launch options). ``reduce_op`` and
            ``skip_nonfinite`` are refused: DiLoCo has no gradient all-reduce.
    """

    strategy_name = "ld_elastic_diloco"

    def __init__(
        self,
        commit_every: int = 50,
        keep: int = 3,
        dirpath: Optional[Union[str, os.PathLike[str]]] = None,
        seed: int = 0,
        on_indivisible: str = "keep_per_rank",
        scale_lr: bool = True,
        background_commits: bool = True,
        **options: Any,
    ) -> None:
        for name in ("skip_nonfinite", "reduce_op"):
            if name in options:
                raise ValueError(
                    f"ElasticDiLoCo: {name}={options[name]!r} is not supported (DiLoCo has no gradient "
                    f"all-reduce); accepted options: {', '.join(self._accepted_options())}"
                )
        self._init_elastic(options_from(ElasticOptions, locals()))  # checks them
        super().__init__(**options)

    @classmethod
    @override
    def _accepted_options(cls) -> list[str]:
        return [*ELASTIC_OPTIONS, *DiLoCo._accepted_options()]

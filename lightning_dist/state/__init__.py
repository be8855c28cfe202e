"""Training state, named once: what each part of a strategy must carry across a checkpoint, a
commit, a restart at another world size or a live recovery, and how a saver stores it.

A strategy owns one ``StateRegistry``; each part registers its pieces there by name (the compressor's
residuals, DiLoCo's last-sync copy, the RNG, HorovodAdasum's optimizer moments), replicated or per
rank. The savers (Lightning's gathered checkpoint, the distributed checkpoint's per-rank keys,
Elastic's commits, torchft's live transfer) read the registry instead of knowing each strategy.
"""

from lightning_dist.state.entries import RankStates
from lightning_dist.state.registry import StateEntry, StateRegistry

__all__ = ["RankStates", "StateEntry", "StateRegistry"]

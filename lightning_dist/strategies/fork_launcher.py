"""The launcher a DDP-family strategy uses: Lightning's, checked before a fork launch, and none at all
in a process that a launcher (torchrun's agent, ``run_elastic``, SLURM, mpirun) started.

The check itself (``check_fork_safe``: CUDA initialised before a fork launch, with the call that did
it) is ``lightning_dist.fork_safety``'s.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from typing_extensions import override

from lightning_dist.compat import _MultiProcessingLauncher
from lightning_dist.fork_safety import check_fork_safe

logger = logging.getLogger(__name__)


class ForkCheckedLauncher(_MultiProcessingLauncher):
    """Lightning's multiprocessing launcher, running ``check_fork_safe`` before it starts the ranks
    (at every ``fit``/``validate``, not at ``Trainer`` construction: CUDA may be touched in between)."""

    def __init__(self, strategy: Any, start_method: Any, owner: str) -> None:
        super().__init__(strategy, start_method=start_method)
        self.owner = owner

    @override
    def launch(self, function: Any, *args: Any, trainer: Optional[Any] = None, **kwargs: Any) -> Any:
        devices = getattr(self._strategy, "parallel_devices", None) or []
        check_fork_safe(self._start_method, self.owner, uses_cuda=any(d.type == "cuda" for d in devices))
        return super().launch(function, *args, trainer=trainer, **kwargs)

    @override
    def _recover_results_in_main_process(self, worker_output: Any, trainer: Any) -> None:
        # Lightning loads rank 0's weights with the device they were saved on: CUDA tensors would
        # initialise CUDA in this process, and every later fork launch from it (the next fit in the
        # notebook) would fail. Load them onto the CPU, where the model lives in this process.
        if worker_output.weights_path is not None:
            io = self._strategy.checkpoint_io
            weights = io.load_checkpoint(worker_output.weights_path, map_location="cpu")
            trainer.lightning_module.load_state_dict(weights, strict=False)
            io.remove_checkpoint(worker_output.weights_path)
            worker_output = worker_output._replace(weights_path=None)
        super()._recover_results_in_main_process(worker_output, trainer)


def checked_launcher(strategy: Any, launcher: Any, owner: str) -> Any:
    """The launcher a DDP-family strategy should use in place of the one Lightning configured.

    - Lightning's multiprocessing launcher (start methods fork, spawn, forkserver) in a process that
      its cluster environment says was started by a launcher (torchrun's agent, ``run_elastic``,
      SLURM, mpirun): None, so ``fit`` runs in this process. Launching would start a second copy of
      every rank under it, which a restart of the agent does not reach.
    - a ``fork`` launcher otherwise: a ``ForkCheckedLauncher`` (``check_fork_safe`` before each launch).
    - anything else: unchanged.
    """
    if not isinstance(launcher, _MultiProcessingLauncher):
        return launcher
    environment = getattr(strategy, "cluster_environment", None)
    if environment is not None and environment.creates_processes_externally:
        logger.debug(
            "%s: this process was started by %s; training runs in it (no %s launch)",
            owner,
            type(environment).__name__,
            launcher._start_method,
        )
        return None
    if launcher._start_method == "fork" and not isinstance(launcher, ForkCheckedLauncher):
        return ForkCheckedLauncher(strategy, launcher._start_method, owner)
    return launcher

"""``FaultTolerant``'s state and commits: what a healthy group sends a recovering one, the pack's
atomic commits (every ``commit_every`` committed steps, by the quorum's participant 0's process 0),
a start from the newest, and a group alone behind it catching up to it."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Optional

import lightning as L
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor

from lightning_dist.elastic.commits import Commit, CommitStore
from lightning_dist.strategies.fault_tolerant_state import OWNER, FaultTolerantState, logger


def resumed_message(step: int, path: object, dirpath: str, max_steps: int) -> str:
    """What a fit that starts from a commit says: which commit, and when ``max_steps`` is already
    reached (the fit then ends at once), how to start afresh."""
    message = f"{OWNER}: resumed from the commit of step {step} ({path})"
    if 0 <= max_steps <= step:
        message += (
            f"; Trainer(max_steps={max_steps}) is reached, nothing is left to train: to start afresh pass "
            f"another FaultTolerant(dirpath=...) or remove {dirpath}"
        )
    return message


class FaultTolerantCommits(FaultTolerantState):
    """The state a peer sends and a commit holds, and the commits (module docstring)."""

    def commit_dir(self, trainer: L.Trainer) -> str:
        """Where the commits are: ``dirpath``, else ``<trainer.default_root_dir>/ft_commits``."""
        return str(self.options.dirpath or os.path.join(trainer.default_root_dir, "ft_commits"))

    def _model_state(self) -> Mapping[str, Tensor]:
        assert self.lightning_module is not None
        return self.lightning_module.state_dict()

    # -- what a peer sends and a commit holds: pieces of the strategy's StateRegistry ---------------
    def register_peer_state(self) -> None:
        """Register the replicated state a healthy group sends a recovering one (torchft's live
        transfer) and a commit holds: the weights, the optimizers, the schedulers, the compressor."""
        state = self.training_state
        state.register("model", self._model_piece, per_rank=False, load=self._load_model)
        state.register("optimizers", self._optimizers_piece, per_rank=False, load=self._load_optimizers)
        state.register("schedulers", self._schedulers_piece, per_rank=False, load=self._load_schedulers)
        state.register(
            "compressor",
            self._compressor_piece,
            per_rank=False,
            active=self._compresses,
            load=self._receive_compressor,
        )

    def _model_piece(self, checkpoint: Mapping[str, Any]) -> dict[str, Tensor]:
        return dict(self._model_state())

    def _optimizers_piece(self, checkpoint: Mapping[str, Any]) -> list[Any]:
        return [opt.state_dict() for opt in self.optimizers]

    def _schedulers_piece(self, checkpoint: Mapping[str, Any]) -> list[Any]:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        return [] if trainer is None else [c.scheduler.state_dict() for c in trainer.lr_scheduler_configs]

    def _compresses(self) -> bool:
        return self.compression is not None

    def _compressor_piece(self, checkpoint: Mapping[str, Any]) -> Any:
        assert self.compression is not None
        peers = 0 if self.transport is None else self.transport.recovering_peers
        return self.compression.state(1 + peers)  # split with the groups this one sends it to (if any)

    def _load_model(self, state: Mapping[str, Tensor]) -> None:
        assert self.lightning_module is not None
        self.lightning_module.load_state_dict(state)

    def _load_optimizers(self, states: list[Any]) -> None:
        for opt, opt_state in zip(self.optimizers, states, strict=True):
            opt.load_state_dict(opt_state)

    def _load_schedulers(self, states: list[Any]) -> None:
        assert self.lightning_module is not None
        configs = self.lightning_module.trainer.lr_scheduler_configs
        for config, sched_state in zip(configs, states, strict=True):
            config.scheduler.load_state_dict(sched_state)

    def _receive_compressor(self, state: Any) -> None:
        if self.compression is not None:
            self.compression.receive(state)  # applied at the step's start

    def _state_dict(self) -> dict[str, Any]:
        return self.training_state.own({}, per_rank=False)

    def _load_state_dict(self, state: dict[str, Any]) -> None:
        self.training_state.load(state)
        logger.debug("%s: state loaded at step %d", OWNER, self.transport.step if self.transport else -1)

    def _resume(self, commit: Commit) -> None:
        """Start from ``commit``: its state loaded, torchft's step set to its step."""
        assert self.transport is not None
        self._load_state_dict(commit.state["state"])
        if self.compression is not None:
            self.compression.from_commit()
        self.transport.resume(commit.step)
        self.resumed_from = commit.step

    def open_commits(self, trainer: L.Trainer) -> None:
        """The commit store; a group that finds a commit there starts from it (and says so)."""
        assert self.transport is not None
        self.store = CommitStore(self.commit_dir(trainer), self.options.keep)
        commit = self._agreed_commit()
        if commit is not None:
            # the floor: a group that finds live peers at a later step still recovers from them
            self._resume(commit)
            rank_zero_info(
                resumed_message(commit.step, commit.path, self.commit_dir(trainer), trainer.max_steps)
            )

    def write_commit(self) -> None:
        """Commit the state of the last committed step, when this group is the quorum's participant 0
        (one writer) and no commit of that step exists."""
        if self.store is None or self.transport is None or not self.options.commit_every:
            return
        step = self.transport.step
        if self.transport.participant_rank != 0 or self._group_rank != 0 or step == 0:
            return
        if self.store.latest_step() == step:
            return
        self.store.save(step, {"state": self._state_dict(), "step": step})

    def _catch_up(self) -> bool:
        """A group alone in its quorum whose step is behind the newest commit (its peers went on and
        ended, or died, while it was stopped or restarting) loads that commit instead of training
        steps the job has already committed; True when it did."""
        assert self.transport is not None
        if self.transport.participants > 1 or self.store is None or not self.options.commit_every:
            return False
        latest = self.store.latest_step()
        newest = self.transport.group_agrees(-1 if latest is None else latest)
        if newest <= self.transport.step:
            return False
        commit = self._agreed_commit()
        if commit is None or commit.step <= self.transport.step:
            return False
        logger.warning(
            "%s: alone at step %d behind the commit of step %d: resuming from it",
            OWNER,
            self.transport.step,
            commit.step,
        )
        self._resume(commit)
        return True

    def _agreed_commit(self) -> Optional[Commit]:
        """The newest intact commit, as the group's rank 0 found it (every process loads that one)."""
        assert self.store is not None and self.transport is not None
        if self.transport.group is None:
            return self.store.load_latest()
        commit = self.store.load_latest() if self._group_rank == 0 else None
        step = self.transport.group_agrees(-1 if commit is None else commit.step)
        if step < 0:
            return None
        return commit if commit is not None else self.store.load(step)

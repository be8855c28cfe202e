"""The DiLoCo sync part alone (``lightning_dist.sync.diloco.DiLoCoSync``), in one process, no Lightning:
its schedule and one sync against torch's SGD stepping the last-sync parameters."""

from __future__ import annotations

import torch
from torch import nn

from lightning_dist.collectives import Communicator, SingleProcessBackend
from lightning_dist.compression import make_compressor
from lightning_dist.sync.diloco import DiLoCoSync


def test_a_sync_is_due_every_inner_steps_and_at_the_end_of_fit() -> None:
    loop = DiLoCoSync(3, 0.7, 0.9, True, True)
    assert not loop.tail_due(), "no outer state before start"
    loop.start(list(nn.Linear(2, 1).named_parameters()))
    assert [loop.step_done(ends=False) for _ in range(2)] == [False, False]
    assert loop.tail_due() and loop.step_done(ends=False)
    loop.inner_step = 0
    assert loop.step_done(ends=True), "the last step of fit syncs inside a period"


def test_one_sync_is_torch_sgd_on_the_last_sync_parameters() -> None:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    start = {n: p.detach().clone() for n, p in module.named_parameters()}
    loop = DiLoCoSync(2, 0.7, 0.9, True, True)
    loop.start(list(module.named_parameters()))
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn_like(p))
    moved = {n: p.detach().clone() for n, p in module.named_parameters()}
    comm = Communicator(SingleProcessBackend())
    loop.sync(comm, make_compressor("none"), module, comm)

    reference = [start[n].clone().requires_grad_() for n in start]
    opt = torch.optim.SGD(reference, lr=0.7, momentum=0.9, nesterov=True)
    for r, n in zip(reference, start, strict=True):
        r.grad = start[n] - moved[n]
    opt.step()
    for (n, p), r in zip(module.named_parameters(), reference, strict=True):
        assert torch.equal(p.detach(), r.detach()), n
    assert (loop.inner_step, loop.syncs) == (0, 1)

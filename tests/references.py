"""Independent references for trainer-level tests: local gradients of the tiny workload, the
pairwise Adasum rule and torch's own optimizers, written without lightning_dist's reduction code."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_dist.workload import TinyCausalLM, WorkloadConfig

Weights = dict[str, Tensor]


def local_gradients(start: Weights, batch: list[Tensor]) -> Weights:
    """Gradient of the tiny workload's loss on ``batch`` at weights ``start``, on this process alone."""
    torch.set_num_threads(1)
    model = TinyCausalLM(WorkloadConfig.tiny(seed=7))
    model.load_state_dict(start)
    loss = torch.nn.functional.cross_entropy(model(batch[0]).flatten(0, 1).float(), batch[1].flatten())
    loss.backward()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def adasum_pair(a: Tensor, b: Tensor) -> Tensor:
    """a (1 - a.b / 2|a|^2) + b (1 - a.b / 2|b|^2) in float64; a zero vector leaves the other as is."""
    a64, b64 = a.double().flatten(), b.double().flatten()
    dot, aa, bb = float(a64 @ b64), float(a64 @ a64), float(b64 @ b64)
    ca = 1.0 - dot / (2 * aa) if aa > 0 else 1.0
    cb = 1.0 - dot / (2 * bb) if bb > 0 else 1.0
    return (ca * a64 + cb * b64).reshape(a.shape)


def optimizer_update(start: Weights, grads: Weights, optimizer: str, lr: float) -> Weights:
    """p_new - p for one step of torch's ``optimizer`` ("sgd" or "adam") from ``start`` with ``grads``."""
    params = {n: torch.nn.Parameter(start[n].clone()) for n in grads}
    for n, p in params.items():
        p.grad = grads[n].clone()
    cls = torch.optim.Adam if optimizer == "adam" else torch.optim.SGD
    cls(list(params.values()), lr=lr).step()
    return {n: p.detach() - start[n] for n, p in params.items()}


def diloco(
    start: Weights,
    batches: list[list[tuple[Tensor, Tensor]]],
    inner_steps: int,
    outer_lr: float,
    outer_momentum: float,
    lr: float,
    weight_decay: float,
    weights: list[float] | None = None,
) -> list[Weights]:
    """DiLoCo written out on one process: rank r runs torch's AdamW on ``batches[r]`` (its own shard,
    in order); every ``inner_steps`` steps the ranks' deltas (last-sync params - params), each times
    ``weights[r]`` (default 1), are averaged
    and a Nesterov SGD step, written as its formula, moves the last-sync params; every rank continues
    from them with its own AdamW state. Returns each rank's final weights."""
    torch.set_num_threads(1)
    ranks = len(batches)
    models = [TinyCausalLM(WorkloadConfig.tiny(seed=7)) for _ in range(ranks)]
    for m in models:
        m.load_state_dict(start)
    names = [n for n, _ in models[0].named_parameters()]
    anchor = {n: start[n].clone().double() for n in names}
    momentum: dict[str, Tensor] = {}
    opts = [torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=weight_decay) for m in models]
    for step in range(len(batches[0])):
        for m, opt, shard in zip(models, opts, batches, strict=True):
            x, y = shard[step]
            loss = torch.nn.functional.cross_entropy(m(x).flatten(0, 1).float(), y.flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
        if (step + 1) % inner_steps:
            continue
        for n in names:
            params = [dict(m.named_parameters())[n].detach().double() for m in models]
            w = weights or [1.0] * ranks
            delta = torch.stack([w[r] * (anchor[n] - p) for r, p in enumerate(params)]).sum(0) / ranks
            momentum[n] = outer_momentum * momentum[n] + delta if n in momentum else delta.clone()
            anchor[n] = anchor[n] - outer_lr * (delta + outer_momentum * momentum[n])
        for m in models:
            with torch.no_grad():
                for n, p in m.named_parameters():
                    p.copy_(anchor[n])
    return [{k: v.detach().clone() for k, v in m.state_dict().items()} for m in models]


def update_space_adasum(
    start: Weights, batches: list[list[tuple[Tensor, Tensor]]], lr: float, weight_decay: float
) -> Weights:
    """HorovodAdasum with AdamW written out on one process for 2 ranks: every step each rank starts
    from the same weights, takes torch's AdamW step (its own moments) on its own batch
    (``batches[r]``, in order), and the weights move by the pairwise Adasum of the two updates,
    parameter by parameter. Returns the final weights."""
    torch.set_num_threads(1)
    models = [TinyCausalLM(WorkloadConfig.tiny(seed=7)) for _ in batches]
    for m in models:
        m.load_state_dict(start)
    opts = [torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=weight_decay) for m in models]
    current = {n: start[n].clone() for n, _ in models[0].named_parameters()}
    for step in range(len(batches[0])):
        deltas = []
        for m, opt, shard in zip(models, opts, batches, strict=True):
            with torch.no_grad():
                for n, p in m.named_parameters():
                    p.copy_(current[n])
            x, y = shard[step]
            loss = torch.nn.functional.cross_entropy(m(x).flatten(0, 1).float(), y.flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
            deltas.append({n: p.detach() - current[n] for n, p in m.named_parameters()})
        current = {n: current[n] + adasum_pair(deltas[0][n], deltas[1][n]).float() for n in current}
    return current


def streaming_diloco(
    start: Weights,
    batches: list[list[tuple[Tensor, Tensor]]],
    inner_steps: int,
    fragments: list[list[str]],
    delay: int,
    alpha: float,
    outer_lr: float,
    outer_momentum: float,
    lr: float,
    weight_decay: float,
) -> list[Weights]:
    """Streaming DiLoCo written out on one process, the last-sync params and outer momentum in
    float64: rank r runs torch's AdamW on ``batches[r]``; with ``every = inner_steps / len(fragments)``,
    fragment k (its parameter names), in turn, takes the ranks' averaged delta (last-sync - params)
    ``delay`` steps before its sync step and at it steps its last-sync params with Nesterov SGD (its
    formula), then each rank's copy becomes ``alpha * its params now + (1 - alpha) * last-sync``. After
    the last batch every fragment syncs at once (one outer step over all, no mixing): the tail.
    Returns each rank's final weights."""
    torch.set_num_threads(1)
    ranks, steps = len(batches), len(batches[0])
    models = [TinyCausalLM(WorkloadConfig.tiny(seed=7)) for _ in range(ranks)]
    for m in models:
        m.load_state_dict(start)
    params = [dict(m.named_parameters()) for m in models]
    anchor = {n: start[n].clone().double() for n in params[0]}
    momentum: dict[str, Tensor] = {}
    opts = [torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=weight_decay) for m in models]
    every = inner_steps // len(fragments)

    def averaged(names: list[str]) -> dict[str, Tensor]:
        return {n: sum(anchor[n] - p[n].detach().double() for p in params) / ranks for n in names}

    def outer_step(delta: dict[str, Tensor]) -> None:
        for n, d in delta.items():
            momentum[n] = outer_momentum * momentum[n] + d if n in momentum else d.clone()
            anchor[n] = anchor[n] - outer_lr * (d + outer_momentum * momentum[n])

    cadence, turn, sent = 0, 0, None
    for step in range(steps):
        for m, opt, shard in zip(models, opts, batches, strict=True):
            x, y = shard[step]
            loss = torch.nn.functional.cross_entropy(m(x).flatten(0, 1).float(), y.flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
        cadence += 1
        if step == steps - 1:  # the tail: every fragment, one outer step, every rank on it
            outer_step(averaged([n for names in fragments for n in names]))
            with torch.no_grad():
                for p in params:
                    for n in p:
                        p[n].copy_(anchor[n])
            break
        names = fragments[turn]
        if delay and cadence == every - delay:
            sent = averaged(names)
        if cadence == every:
            outer_step(sent if delay else averaged(names))
            with torch.no_grad():
                for p in params:
                    for n in names:
                        p[n].copy_(alpha * p[n].detach().double() + (1 - alpha) * anchor[n])
            cadence, turn, sent = 0, (turn + 1) % len(fragments), None
    return [{k: v.detach().clone() for k, v in m.state_dict().items()} for m in models]

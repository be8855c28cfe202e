"""A compressor's rounds computed in a transport's callback thread give every rank the same result.

``run_exchanges`` starts each round from the completion callback of the one before, so a round's
compute (PowerSGD's GEMMs) runs on whichever thread completed the collective: the caller's, or one of
Gloo's. torch keeps MKL's thread count per thread, and a GEMM split over another number of threads
rounds differently, so without ``same_threads_as_caller`` the ranks' "identical" results differed in
their last bits from run to run (seen: final weights of ``Compressed("powersgd")`` differed between
the two ranks of one run, and between two runs).
"""

from __future__ import annotations

import torch

from lightning_dist.collectives import Communicator
from lightning_dist.collectives.exchanges import run_exchanges
from lightning_dist.compression import make_compressor
from lightning_dist.testing import run_in_threads


def test_powersgd_rounds_give_every_rank_bitwise_the_same_result() -> None:
    def body(comm: Communicator) -> list[list[torch.Tensor]]:
        torch.set_num_threads(1)  # as a training rank does; a Gloo thread starts with MKL's default
        gen = torch.Generator().manual_seed(comm.rank)
        compressor = make_compressor("powersgd")
        results = []
        for _ in range(8):  # more steps: more rounds land on a Gloo thread
            grads = [torch.randn(2048, 512, generator=gen), torch.randn(256, 4096, generator=gen)]
            exchange = compressor.exchange(0, grads, world_size=comm.world_size, rank=comm.rank)
            run_exchanges(comm, [[exchange]]).wait()
            assert exchange.result is not None
            results.append(exchange.result)
        return results

    rank0, rank1 = run_in_threads(2, body)
    diffs = [(x - y).abs().max().item() for a, b in zip(rank0, rank1) for x, y in zip(a, b)]
    assert diffs == [0.0] * len(diffs), f"the ranks' decompressed gradients differ: {diffs}"

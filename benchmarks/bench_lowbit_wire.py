"""DiLoCo's pseudo-gradient wire formats side by side, in one process (W ranks simulated).

    python benchmarks/bench_lowbit_wire.py [--numel 4194304] [--world-sizes 2 8] [--repeats 5]

Printed per format: bytes one rank sends per element at each world size (the wire model, the
same the collectives count), their ratio against a ring all-reduce in fp32, the relative l2 error
of one exchange's average against the float64 mean of 2 ranks' Gaussian pseudo-gradients (for
sparseloco: of the first exchange, what error feedback later makes up), and the median CPU time of
a simulated 2-rank exchange (both ranks' work, no transport).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from lightning_dist.compression import make_compressor, reference_bytes, simulate

FORMATS = ("none", "fp16", "bf16", "int8", "int4", "sparseloco")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--numel", type=int, default=1 << 22)
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 8])
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    torch.manual_seed(0)
    xs = [torch.randn(a.numel) * 1e-3 for _ in range(2)]
    mean = (xs[0].double() + xs[1].double()) / 2
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {a.numel} elements")
    head = " ".join(f"B/elt W={w} (ratio)" for w in a.world_sizes)
    print(f"{'format':<11} {head}  rel.l2 err  ms/exchange (W=2, CPU)")
    for name in FORMATS:
        cells = []
        for w in a.world_sizes:
            wire = make_compressor(name).wire_bytes([(a.numel,)], w)
            cells.append(f"{wire / a.numel:8.4f} ({wire / reference_bytes([(a.numel,)], w):.3f})")
        times, err = [], 0.0
        for i in range(a.repeats):
            comps = [make_compressor(name) for _ in range(2)]
            start = time.perf_counter()
            out = simulate(
                [c.exchange(0, [x], world_size=2, rank=r) for r, (c, x) in enumerate(zip(comps, xs))]
            )
            times.append(time.perf_counter() - start)
            if i == 0:
                err = float((out[0][0].double() - mean).norm() / mean.norm())
        print(f"{name:<11} {' '.join(cells)}  {err:10.4f}  {1e3 * statistics.median(times):8.1f}")


if __name__ == "__main__":
    main()

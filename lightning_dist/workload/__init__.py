"""The workload shared by examples, tests, notebooks and benchmarks."""

from lightning_dist.workload.data import TextBlocks, load_corpus, stdlib_sources
from lightning_dist.workload.figures import figures_dir
from lightning_dist.workload.model import TinyCausalLM, WorkloadConfig

__all__ = ["TextBlocks", "TinyCausalLM", "WorkloadConfig", "figures_dir", "load_corpus", "stdlib_sources"]

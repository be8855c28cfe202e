"""Monitoring callbacks: ``CommMonitor`` (per-step counters), ``Timeline`` (a Chrome trace)."""

from lightning_dist.callbacks.monitor import CommMonitor
from lightning_dist.callbacks.timeline import Timeline

__all__ = ["CommMonitor", "Timeline"]

"""Monitoring callbacks."""

from lightning_dist.callbacks.monitor import CommMonitor

__all__ = ["CommMonitor"]

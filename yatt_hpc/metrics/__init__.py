"""Metrics: a no-op writer for every rank but the leader, TensorBoard + JSONL behind the same interface."""
from yatt_hpc.metrics.writer import BaseMetrics, NullMetrics, RunMetrics, build_metrics

__all__ = ["BaseMetrics", "NullMetrics", "RunMetrics", "build_metrics"]

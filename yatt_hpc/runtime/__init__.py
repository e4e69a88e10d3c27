"""The process runtime of a rank: the worker entry, the step loop, signals, the stop watchdog, the
health monitor, per-rank stats and the run summary."""

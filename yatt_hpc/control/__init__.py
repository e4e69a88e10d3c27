"""Parallel controllers: one MPI world, group communicators, the GRPO step loop."""

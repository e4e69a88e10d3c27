"""yatt-hpc: Slurm-native RL post-training with parallel MPI controllers."""
__version__ = "0.1.0"

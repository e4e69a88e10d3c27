"""Launching: the only package that runs mpirun/srun/sbatch/scontrol/sacct or submitit."""

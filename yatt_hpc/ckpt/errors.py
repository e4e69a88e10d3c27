"""The checkpoint component's one exception (kept free of torch/h5py so the CLI imports fast).

    from yatt_hpc.ckpt.errors import CheckpointError
"""


class CheckpointError(RuntimeError):
    """A save could not be committed, or a checkpoint cannot be loaded; the message says why."""

"""The role controllers (trainer, rollout, GenRM, the engine pool of a dynamic split) and the one
module that declares the step protocol they all walk (`protocol.py`)."""

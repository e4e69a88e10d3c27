"""The trainer: Megatron-core model building, HF <-> Megatron weights, log-probs (import submodules)."""

"""The trainer's optimizer: AdamW without torch.optim's start-up cost (`adamw.py`), its ZeRO-1 sharding over the
data-parallel ranks (`sharded.py`), and the bucketed gradient all-reduce (`buckets.py`). Torch only."""

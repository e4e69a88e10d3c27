"""PPO's value model (docs/critic.md): the GPTModel with a scalar head and its HF layout (`model`), its values
and its update (`update`)."""

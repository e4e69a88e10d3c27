"""Mixture-of-experts policies beyond the layers themselves: routing replay of the engine's experts (docs/moe.md)."""

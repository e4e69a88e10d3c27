"""Prompt data: the character tokenizer, the built-in demo task, and prompt sources for the trainer."""

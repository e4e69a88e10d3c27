"""Demo-only code: the character tokenizer, the reverse-a-word task, tiny models built from configs.
The library's real paths never depend on it, except `data.tokenizer.load_tokenizer`, which loads the
character tokenizer when a model directory holds one."""

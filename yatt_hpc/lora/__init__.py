"""LoRA: adapters on the trainer's linear layers, their PEFT layout, merged weights and base identity (docs/lora.md)."""

"""Images: reading and checking encoded images, and a vision-language model's image inputs (processor)."""

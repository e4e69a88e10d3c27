"""Images: encoded bytes checked from their header, decoded to RGB where they are consumed, and a
vision-language model's image inputs built from them.

    from yatt_hpc.vision.images import ImageLimits, check_image_bytes, decode_image
    width, height, fmt = check_image_bytes(data, "train.jsonl:3 image 0", ImageLimits())
    image = decode_image(data, "train.jsonl:3 image 0", ImageLimits())   # a PIL RGB image
    from yatt_hpc.vision.processor import ImageProcessor                 # pads, pixel values, M-RoPE

A leaf: imports nothing of yatt_hpc and no torch at import (Pillow, numpy; transformers' PIL image
processor lazily), so every component (data, rollout, train) may use it.
"""

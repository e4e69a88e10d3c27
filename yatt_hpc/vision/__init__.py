"""Images: encoded bytes checked from their header, decoded to RGB where they are consumed (Pillow only, no torch).

    from yatt_hpc.vision.images import ImageLimits, check_image_bytes, decode_image
    width, height, fmt = check_image_bytes(data, "train.jsonl:3 image 0", ImageLimits())
    image = decode_image(data, "train.jsonl:3 image 0", ImageLimits())   # a PIL RGB image

A leaf: imports nothing of yatt_hpc, so every component (data, rollout, train) may use it.
"""

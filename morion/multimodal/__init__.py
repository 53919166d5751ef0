"""Images for vision-language models: decoding and resizing (`image_decode.py`, the server's front end),
the processor's settings (`processing.py`), patches (`patches.py`) and three-axis rotary positions plus
cache keys of prompts with images (`prompt_images.py`, the engine)."""

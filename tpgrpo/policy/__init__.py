"""The policy: LoRA adapters on a backend (load, save, EMA), the update step, image generation for eval
and figures, and export of a trained adapter."""

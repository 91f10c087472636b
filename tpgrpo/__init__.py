"""tpgrpo: TP-GRPO post-training of flow-matching text-to-image models as reproducible stages."""

__version__ = "0.1.0"

"""Tiny reward models built from configs and saved in the layouts the rewards load (offline, seconds).

- `save_tiny_clip`: a CLIPModel + CLIPProcessor (PickScore_v1's layout: one save_pretrained folder).
- `save_tiny_owlvit`: an OwlViTForObjectDetection + OwlViTProcessor (zero-shot detector).
- `save_tiny_detr`: a DetrForObjectDetection (closed set, ResNet backbone from config) + image processor.
- `save_tiny_aesthetic_head`: the LAION aesthetic MLP's state dict for a CLIP of projection size D.
The tokenizer is a CLIPTokenizer over a character vocabulary (no merges) written to a temp folder.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

import torch

IMAGE = 32  # px, the embedded task's image size


def _tokenizer(folder: Path, max_length: int):
    from transformers import CLIPTokenizer

    vocab: dict[str, int] = {}
    for c in string.ascii_lowercase + string.digits + '"':
        vocab.setdefault(c, len(vocab))
        vocab.setdefault(c + "</w>", len(vocab))
    vocab["<|startoftext|>"], vocab["<|endoftext|>"] = len(vocab), len(vocab) + 1
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    tok = CLIPTokenizer(str(folder / "vocab.json"), str(folder / "merges.txt"))
    tok.model_max_length = max_length
    return tok, vocab


def _text_config(vocab: dict[str, int], max_positions: int) -> dict:
    return dict(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2, max_position_embeddings=max_positions,
                bos_token_id=vocab["<|startoftext|>"], eos_token_id=vocab["<|endoftext|>"],
                pad_token_id=vocab["<|endoftext|>"])


VISION = dict(image_size=IMAGE, patch_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
              num_attention_heads=2)


def save_tiny_clip(folder: Path, seed: int = 0, logit_scale: float = 100.0) -> Path:
    """A random CLIP (projection 16) with PickScore's logit scale (100), saved with its processor."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    tok, vocab = _tokenizer(folder.parent / f"{folder.name}-tokenizer", 64)
    torch.manual_seed(seed)
    model = CLIPModel(CLIPConfig(text_config=_text_config(vocab, 64), vision_config=VISION, projection_dim=16))
    with torch.no_grad():
        model.logit_scale.fill_(float(torch.tensor(logit_scale).log()))
    model.eval().save_pretrained(folder)
    image_processor = CLIPImageProcessor(size={"shortest_edge": IMAGE}, crop_size={"height": IMAGE, "width": IMAGE})
    CLIPProcessor(image_processor=image_processor, tokenizer=tok).save_pretrained(folder)
    return folder


def save_tiny_owlvit(folder: Path, seed: int = 0) -> Path:
    """A random OWL-ViT (4x4 patches -> 16 boxes per image), saved with its processor."""
    from transformers import OwlViTConfig, OwlViTForObjectDetection, OwlViTImageProcessor, OwlViTProcessor

    tok, vocab = _tokenizer(folder.parent / f"{folder.name}-tokenizer", 16)
    torch.manual_seed(seed)
    config = OwlViTConfig(text_config=_text_config(vocab, 16), vision_config=VISION, projection_dim=32)
    OwlViTForObjectDetection(config).eval().save_pretrained(folder)
    image_processor = OwlViTImageProcessor(size={"height": IMAGE, "width": IMAGE},
                                           crop_size={"height": IMAGE, "width": IMAGE})
    OwlViTProcessor(image_processor=image_processor, tokenizer=tok).save_pretrained(folder)
    return folder


def save_tiny_detr(folder: Path, labels: tuple[str, ...] = ("circle", "square", "triangle"), seed: int = 0) -> Path:
    """A random DETR (ResNet backbone from config, 6 queries) over ``labels``, saved with its image processor."""
    from transformers import DetrConfig, DetrForObjectDetection, DetrImageProcessor, ResNetConfig

    backbone = ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], out_features=["stage2"],
                            layer_type="basic")
    config = DetrConfig(use_timm_backbone=False, backbone_config=backbone, use_pretrained_backbone=False,
                        d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, num_queries=6,
                        id2label=dict(enumerate(labels)), label2id={n: i for i, n in enumerate(labels)})
    torch.manual_seed(seed)
    DetrForObjectDetection(config).eval().save_pretrained(folder)
    DetrImageProcessor(size={"shortest_edge": IMAGE, "longest_edge": IMAGE}, do_pad=False).save_pretrained(folder)
    return folder


def save_tiny_aesthetic_head(path: Path, dim: int = 16, seed: int = 0) -> Path:
    """The LAION aesthetic MLP's state dict (layers.{0,2,4,6,7}) for embeddings of size ``dim``."""
    torch.manual_seed(seed)
    sizes = [(dim, 1024), (1024, 128), (128, 64), (64, 16), (16, 1)]
    state = {}
    for index, (a, b) in zip((0, 2, 4, 6, 7), sizes):
        layer = torch.nn.Linear(a, b)
        state[f"layers.{index}.weight"], state[f"layers.{index}.bias"] = layer.weight.data, layer.bias.data
    torch.save(state, path)
    return path

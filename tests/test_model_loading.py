"""Real-model weights load straight onto the backend's device: no staging of the transformer and
VAE in host memory first (SD3.5-M: 5 GiB per process, times the processes of a node).

No GPU here: the CPU path is checked for the same tensors as a stock load and a working LoRA step, and the
device a load asks for is checked by stopping the load at ``from_pretrained``.
"""

from __future__ import annotations

import pytest
import torch


class _Asked(Exception):
    pass


def _loaders():
    from tpgrpo.models.flux import load_flux
    from tpgrpo.models.sd3 import load_sd3

    return {"sd3": load_sd3, "flux": load_flux}


@pytest.mark.parametrize("kind", ["sd3", "flux"])
def test_the_transformer_and_vae_are_read_onto_the_requested_device(kind, sd3_model_dir, flux_model_dir,
                                                                    monkeypatch):
    """Fails on a loader that reads to the CPU and moves the modules afterwards (no ``device_map``)."""
    from diffusers import ModelMixin

    folder = sd3_model_dir if kind == "sd3" else flux_model_dir
    asked = []

    def record(cls, path, **kwargs):
        asked.append((cls.__name__, kwargs.get("subfolder"), kwargs.get("device_map")))
        raise _Asked

    monkeypatch.setattr(ModelMixin, "from_pretrained", classmethod(record))
    with pytest.raises(_Asked):
        _loaders()[kind](folder, device="cuda:1", dtype=torch.bfloat16)
    name, subfolder, device_map = asked[0]
    assert subfolder == "transformer" and device_map == {"": torch.device("cuda:1")}, asked


@pytest.mark.parametrize("kind", ["sd3", "flux"])
def test_loading_to_the_device_gives_the_stock_tensors(kind, sd3_model_dir, flux_model_dir):
    from diffusers import AutoencoderKL, FluxTransformer2DModel, SD3Transformer2DModel

    folder = sd3_model_dir if kind == "sd3" else flux_model_dir
    backend = _loaders()[kind](folder, device="cpu", dtype=torch.bfloat16)
    stock_cls = SD3Transformer2DModel if kind == "sd3" else FluxTransformer2DModel
    stock = {"transformer": stock_cls.from_pretrained(folder, subfolder="transformer", dtype=torch.bfloat16),
             "vae": AutoencoderKL.from_pretrained(folder, subfolder="vae", dtype=torch.float32)}
    for part, module in stock.items():
        loaded = getattr(backend, part).state_dict()
        assert loaded.keys() == module.state_dict().keys()
        for key, value in module.state_dict().items():
            assert loaded[key].dtype == value.dtype and torch.equal(loaded[key], value), (part, key)


def test_a_device_placed_transformer_takes_a_lora_step(sd3_model_dir):
    """The single-device placement marks the model (``hf_device_map``); peft and AdamW still train it."""
    from tpgrpo.policy.lora import attach_lora

    backend = _loaders()["sd3"](sd3_model_dir, device="cpu")
    assert getattr(backend.transformer, "hf_device_map", None) == {"": torch.device("cpu")}
    attach_lora(backend, rank=4, alpha=8)
    params = [p for p in backend.transformer.parameters() if p.requires_grad]
    assert params, "no trainable LoRA parameters"
    before = [p.detach().clone() for p in params]
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    x = torch.randn(2, *backend.latent_shape)
    embeds = backend.encode_prompts(["a red circle", "two blue squares"])
    loss = backend.velocity(x, torch.tensor([0.7, 0.4]), embeds, guidance_scale=1.0).square().mean()
    loss.backward()
    optimizer.step()
    assert any(not torch.equal(a, p.detach()) for a, p in zip(before, params))

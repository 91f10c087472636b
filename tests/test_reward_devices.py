"""Where each process's reward models go (``reward_models.device``) when a stage runs on several processes:
resolved per local rank as ``model.device`` is, never the same GPU for every rank (fast, no GPU: fake ``Dist``s;
no weights load, ``from_config`` only checks the folders)."""

from __future__ import annotations

import pytest
from conftest import tiny_params

from tpgrpo.config import config_from_dict
from tpgrpo import distributed
from tpgrpo.distributed import Dist, reward_device
from tpgrpo.rewards.aesthetic import AestheticReward
from tpgrpo.rewards.detector import GenEvalDetectorReward
from tpgrpo.rewards.pickscore import PickScoreReward

# rank r of n processes, 4 per node: (dist, device written in params, device the reward models get)
CASES = [
    (Dist(rank=0, world=1, local_rank=0), "cuda:1", "cuda:1"),  # one process: as written
    (Dist(rank=0, world=1, local_rank=0), "cuda", "cuda"),
    (Dist(rank=2, world=4, local_rank=2), "cuda:1", "cuda:2"),
    (Dist(rank=0, world=4, local_rank=0), "cuda:1", "cuda:0"),
    (Dist(rank=5, world=8, local_rank=1), "cuda", "cuda:1"),  # second node: its local GPU 1
    (Dist(rank=3, world=4, local_rank=3), "cpu", "cpu"),
]


@pytest.fixture
def as_process(monkeypatch):
    """Make ``current()`` answer a given ``Dist``, as ``init`` does in a launched process."""
    def set_dist(dist: Dist) -> None:
        monkeypatch.setattr(distributed, "_CURRENT", dist)
    return set_dist


@pytest.mark.parametrize("dist, written, expected", CASES)
def test_reward_device_is_this_processs_gpu(as_process, dist, written, expected):
    as_process(dist)
    assert reward_device(written) == expected


def _folders(tmp_path):
    clip = tmp_path / "clip"
    clip.mkdir()
    for name in ("config.json", "model.safetensors", "preprocessor_config.json", "tokenizer.json"):
        (clip / name).write_text("{}")
    (tmp_path / "head.pth").write_bytes(b"")
    return {"pickscore_path": "clip", "aesthetic_clip_path": "clip", "aesthetic_head_path": "head.pth",
            "geneval_detector_path": "clip"}


@pytest.mark.parametrize("dist, written, expected", CASES)
def test_every_reward_model_is_built_on_this_processs_device(tmp_path, as_process, dist, written, expected):
    raw = tiny_params()
    raw["reward_models"].update(device=written, **_folders(tmp_path))
    cfg = config_from_dict(raw)
    as_process(dist)
    built = {
        "pickscore": PickScoreReward.from_config(cfg, tmp_path).device,
        "aesthetic": AestheticReward.from_config(cfg, tmp_path).device,
        "geneval_detector": GenEvalDetectorReward.from_config(cfg, tmp_path).detector.device,
    }
    assert built == dict.fromkeys(built, expected)

"""The typed, validated configuration loaded from ``params.yaml``.

``params.yaml`` is the one place values live, one section per concern. Every field below has a
docstring-style comment with its unit. Loading is strict: an unknown key, a missing key, a value of the
wrong type or out of range raises :class:`ConfigError` with one line naming the key and what is expected.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_type_hints

import yaml


class ConfigError(ValueError):
    """A bad ``params.yaml``: the message names the key and what is expected."""


@dataclass(frozen=True)
class ModelConfig:
    kind: str = "tiny"  # backend: tiny | sd3 | flux
    path: str = "data/base"  # local folder in the diffusers save_pretrained layout
    device: str = "cpu"  # torch device for every model stage
    dtype: str = "fp32"  # fp32 | bf16 | fp16 (the step maths always runs in fp32)
    resolution: int = 0  # image side in pixels; 0 = the backend's default (tiny: its own 32; sd3/flux: 512)


@dataclass(frozen=True)
class TaskConfig:
    train_prompts: str = "data/prompts/compositional_train.jsonl"  # JSONL of prompt metadata
    eval_prompts: str = "data/prompts/compositional_eval.jsonl"  # held-out JSONL
    # Reward specs: a name from tpgrpo.tasks.rewards, or a mapping name -> weight (the weighted sum;
    # strict accuracy = that of the first component that defines one).
    reward: str | dict[str, float] = "geneval_soft"  # training signal
    eval_reward: str | dict[str, float] = "geneval"  # reported at eval (strict accuracy comes with it)


@dataclass(frozen=True)
class RewardModelsConfig:
    """Local folders of the reward models (nothing is downloaded) and how they run; "" = not configured."""

    device: str = "cpu"  # torch device of the reward models (e.g. cuda); they always run in fp32
    batch_size: int = 32  # images per reward-model forward pass (memory knob, no effect on results)
    pickscore_path: str = ""  # CLIP save_pretrained folder of PickScore_v1 (config.json, weights)
    pickscore_processor_path: str = ""  # its CLIP processor folder; "" = pickscore_path
    pickscore_divisor: float = 26.0  # reward = 100 * cos(text, image) / divisor (raw PickScore ~21-23)
    geneval_detector_path: str = ""  # OWL-ViT / OWLv2 / AutoModelForObjectDetection save_pretrained folder
    geneval_detector_threshold: float = 0.3  # detection score a box needs (in [0, 1]; GenEval: 0.3)
    aesthetic_clip_path: str = ""  # CLIP ViT-L/14 save_pretrained folder for the aesthetic head
    aesthetic_head_path: str = ""  # LAION aesthetic MLP weights (.pth / .safetensors state dict)


@dataclass(frozen=True)
class RemoteRewardConfig:
    """The reward server the "remote" reward posts to (`tpgrpo serve-reward`)."""

    url: str = ""  # e.g. http://127.0.0.1:8765/score; "" = not configured
    timeout: float = 120.0  # seconds per request before it counts as failed
    retries: int = 3  # extra attempts after a failed request (unreachable, timeout, HTTP 5xx)
    backoff: float = 1.0  # seconds before the first retry; doubles with each further retry
    batch_size: int = 64  # images per request
    encoding: str = "png"  # image encoding in the request: png (lossless, smaller) | raw (uint8 bytes)


@dataclass(frozen=True)
class SamplingConfig:
    num_steps: int = 10  # T, denoising steps per rollout
    shift: float = 1.0  # FlowMatchEulerDiscreteScheduler shift (SD3.5-M: 3)
    guidance_scale: float = 4.5  # classifier-free guidance g
    step_kind: str = "sde"  # stochastic step: sde (Flow-GRPO) | cps (coefficients-preserving)
    noise_level: float = 0.7  # eta (the paper's alpha)
    window_start: int = 0  # first stochastic step
    window_size: int = 9  # w, number of stochastic (stored, trained) steps


@dataclass(frozen=True)
class RolloutConfig:
    prompts_per_iter: int = 8  # prompt groups per iteration
    group_size: int = 8  # G, samples per prompt
    batch_size: int = 64  # images per forward pass (memory knob, no effect on results)


@dataclass(frozen=True)
class ProbeConfig:
    batch_size: int = 128  # states per forward pass during ODE completion
    # How a state is scored (tpgrpo.algo.probe_modes): exact (the rest of the schedule) | ode:M (at most M Euler
    # steps, re-spaced) | x0 (z_k - s_k v_k from the rollout's own velocity: no transformer pass)
    completion: str = "exact"


@dataclass(frozen=True)
class CreditConfig:
    mode: str = "tp"  # tp | tp_unconstrained | incremental | flow_grpo
    balance: str = "group"  # turning-point sign balancing: group | none
    global_std: bool = False  # normalise by the std over the whole iteration (per step)
    adv_clip: float = 5.0  # advantages clipped to [-adv_clip, adv_clip]


@dataclass(frozen=True)
class UpdateConfig:
    lora_rank: int = 16  # LoRA rank r on the attention projections
    lora_alpha: int = 32  # LoRA alpha (scale alpha / r)
    lr: float = 3e-4  # AdamW learning rate
    weight_decay: float = 1e-4  # AdamW weight decay
    clip_range: float = 1e-4  # PPO ratio clip eps
    kl_beta: float = 0.0  # weight of the KL to the reference; release's scale: std without sqrt(-dt)
    optimizer_steps_per_iter: int = 2  # optimizer steps per iteration (gradient accumulation)
    epochs: int = 1  # passes over the iteration's transitions; the optimizer steps are split evenly over them
    micro_batch: int = 32  # transitions per backward pass (memory knob)
    max_grad_norm: float = 1.0  # gradient-norm clip
    ema: bool = False  # keep an EMA of the LoRA weights for eval/export
    gradient_checkpointing: bool = False  # recompute block activations in backward: less memory, ~30% slower


@dataclass(frozen=True)
class EvalConfig:
    every: int = 1  # evaluate after every N iterations (0 = never)
    num_steps: int = 40  # ODE steps at eval
    num_prompts: int = 32  # held-out prompts evaluated (first N of the eval file)
    samples_per_prompt: int = 2  # seeds per prompt
    seed: int = 0  # eval seeds derive from this, not train.seed: runs with other train seeds stay paired


@dataclass(frozen=True)
class TrainConfig:
    iterations: int = 4  # RL iterations that `dvc repro` runs
    seed: int = 0  # run seed: every sample's seed derives from (seed, iteration, prompt, sample)
    block_size: int = 25  # finished iterations sealed into one DVC stage per block of this many (0 = never)


@dataclass(frozen=True)
class RetentionConfig:
    """What ``tpgrpo retain`` keeps of sealed blocks. Never changes an artifact; no stage reads it."""

    keep_trajectories: int = 0  # trajectories + prompt embeddings of the last k finished iterations (0 = all)
    keep_adapter_every: int = 0  # adapters of every m-th iteration, plus each block's last (0 = all)


@dataclass(frozen=True)
class LaunchConfig:
    """How the model stages (rollout, probe, update, eval, baseline) are launched. Never changes an
    artifact: no stage declares these params; dvc.yaml's commands carry the process count."""

    num_processes: int = 1  # processes on this machine (one per GPU); 1 = plain `tpgrpo stage`, no accelerate
    config_file: str = ""  # accelerate config file (multi-node, DeepSpeed); it sets the process count
    timeout_s: float = 1800.0  # seconds a process waits at a barrier / all-reduce before failing the stage
    # `tpgrpo run` on the CPU with one process per stage (Linux): stage processes fork from a server that
    # imported torch/diffusers/transformers/peft once (tpgrpo.pipeline.stage_server); false = each imports its own
    stage_server: bool = True


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    reward_models: RewardModelsConfig = field(default_factory=RewardModelsConfig)
    remote_reward: RemoteRewardConfig = field(default_factory=RemoteRewardConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    probe: ProbeConfig = field(default_factory=ProbeConfig)
    credit: CreditConfig = field(default_factory=CreditConfig)
    update: UpdateConfig = field(default_factory=UpdateConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    retention: RetentionConfig = field(default_factory=RetentionConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)

    def params_hash(self, keys: list[str] | tuple[str, ...]) -> str:
        """Short sha256 of the given params (``"model"`` = a whole section, ``"task.reward"`` = one key),
        recorded in artifacts to tie them to the params that made them."""
        payload = {}
        for key in keys:
            section, _, name = key.partition(".")
            values = dataclasses.asdict(getattr(self, section))
            payload[key] = values[name] if name else values
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


CHOICES = {
    "model.kind": ("tiny", "sd3", "flux"),
    "model.dtype": ("fp32", "bf16", "fp16"),
    "sampling.step_kind": ("sde", "cps"),
    "credit.mode": ("tp", "tp_unconstrained", "incremental", "flow_grpo"),
    "credit.balance": ("group", "none"),
    "remote_reward.encoding": ("png", "raw"),
}
REWARD_SPECS = {"task.reward", "task.eval_reward"}  # a reward name or a mapping name -> weight
UNIT_INTERVAL = {"reward_models.geneval_detector_threshold"}  # in [0, 1]
POSITIVE = {
    "sampling.num_steps", "sampling.shift", "rollout.prompts_per_iter", "rollout.group_size",
    "rollout.batch_size", "probe.batch_size", "update.lora_rank", "update.lora_alpha", "update.lr",
    "update.clip_range", "update.optimizer_steps_per_iter", "update.epochs", "update.micro_batch",
    "update.max_grad_norm", "credit.adv_clip", "eval.num_steps", "eval.num_prompts",
    "eval.samples_per_prompt", "train.iterations", "launch.num_processes", "launch.timeout_s",
}
NON_NEGATIVE = {
    "sampling.guidance_scale", "sampling.noise_level", "sampling.window_start",
    "sampling.window_size", "update.weight_decay", "update.kl_beta", "eval.every", "eval.seed", "train.seed",
    "remote_reward.retries", "remote_reward.backoff", "model.resolution", "train.block_size",
    "retention.keep_trajectories", "retention.keep_adapter_every",
}
POSITIVE |= {"reward_models.batch_size", "reward_models.pickscore_divisor", "remote_reward.timeout",
             "remote_reward.batch_size"}


def _coerce(key: str, value: Any, kind: type) -> Any:
    """Check ``value`` against the annotated type; ints are accepted where floats are expected."""
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind is float:
        if isinstance(value, str):  # PyYAML reads `3e-4` (no dot) as a string: accept what float() reads
            try:
                value = float(value)
            except ValueError:
                pass
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        value = float(value) if ok else value
    else:
        ok = isinstance(value, kind)
    if not ok:
        raise ConfigError(f"params: {key} = {value!r}: expected {kind.__name__}")
    return value


def _check_range(key: str, value: Any) -> None:
    if key == "probe.completion":
        from tpgrpo.algo.probe_modes import EXPECTED, parse_completion  # no torch: a few pure functions

        try:
            parse_completion(value)
        except ValueError:
            raise ConfigError(f"params: {key} = {value!r}: expected {EXPECTED}") from None
    if key in CHOICES and value not in CHOICES[key]:
        raise ConfigError(f"params: {key} = {value!r}: expected one of {', '.join(CHOICES[key])}")
    if key in POSITIVE and value <= 0:
        raise ConfigError(f"params: {key} = {value!r}: expected a value > 0")
    if key in NON_NEGATIVE and value < 0:
        raise ConfigError(f"params: {key} = {value!r}: expected a value >= 0")
    if key in UNIT_INTERVAL and not 0.0 <= value <= 1.0:
        raise ConfigError(f"params: {key} = {value!r}: expected a value in [0, 1]")


def _build_section(name: str, cls: type, raw: Any) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(f"params: {name}: expected a mapping of keys, got {type(raw).__name__}")
    hints = get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in raw:
        if key not in hints:
            raise ConfigError(f"params: unknown key {name}.{key} (known: {', '.join(names)})")
    values = {}
    for key in names:
        if key not in raw:
            raise ConfigError(f"params: missing key {name}.{key}")
        if f"{name}.{key}" in REWARD_SPECS:
            values[key] = _reward_spec(f"{name}.{key}", raw[key])
            continue
        values[key] = _coerce(f"{name}.{key}", raw[key], hints[key])
        _check_range(f"{name}.{key}", values[key])
    return cls(**values)


def _reward_spec(key: str, value: Any) -> str | dict[str, float]:
    """A reward name, or a non-empty mapping name -> finite weight; names from the reward registry."""
    from tpgrpo.tasks.rewards import REWARD_NAMES  # lazy: the registry imports the task code

    known = f"known rewards: {', '.join(REWARD_NAMES)}"
    if isinstance(value, str):
        if value not in REWARD_NAMES:
            raise ConfigError(f"params: {key} = {value!r}: unknown reward ({known})")
        return value
    if not isinstance(value, dict) or not value:
        raise ConfigError(f"params: {key} = {value!r}: expected a reward name or a mapping name -> weight "
                          f"({known})")
    spec = {}
    for name, weight in value.items():
        if name not in REWARD_NAMES:
            raise ConfigError(f"params: {key}.{name}: unknown reward ({known})")
        spec[name] = _coerce(f"{key}.{name}", weight, float)
    return spec


def _check_consistency(cfg: Config) -> None:
    if cfg.launch.config_file and cfg.launch.num_processes != 1:
        raise ConfigError(
            f"params: launch.num_processes = {cfg.launch.num_processes} with launch.config_file set: "
            "expected 1 (the accelerate config file sets the process count)")
    s = cfg.sampling
    if s.window_start + s.window_size > s.num_steps:
        raise ConfigError(
            f"params: sampling.window_start + sampling.window_size = {s.window_start + s.window_size}: "
            f"expected <= sampling.num_steps ({s.num_steps})")
    if s.window_size < 1:
        raise ConfigError("params: sampling.window_size = 0: expected at least one stochastic step")
    if s.step_kind == "sde" and s.window_start + s.window_size == s.num_steps:
        # An sde step at the last step (s -> 0) leaves noise std * sqrt(s) in the final latent;
        # cps is deterministic there (its noise is s_{k+1} sin(.) = 0), so it may reach the end.
        raise ConfigError(
            f"params: sampling.window_start + sampling.window_size = {s.window_start + s.window_size} with "
            f"sampling.step_kind = sde: expected <= {s.num_steps - 1} (sampling.num_steps - 1; an sde step "
            "at the last step puts noise into the final latent; cps may reach it)")
    u = cfg.update
    if u.optimizer_steps_per_iter % u.epochs:
        raise ConfigError(
            f"params: update.optimizer_steps_per_iter = {u.optimizer_steps_per_iter}: expected a multiple of "
            f"update.epochs ({u.epochs}), the steps are split evenly over the passes")
    if cfg.rollout.group_size < 2:
        raise ConfigError(
            f"params: rollout.group_size = {cfg.rollout.group_size}: expected >= 2 (GRPO needs a group)")


def config_from_dict(raw: Any) -> Config:
    """Build a validated :class:`Config` from a parsed ``params.yaml`` mapping."""
    if not isinstance(raw, dict):
        raise ConfigError("params: expected a mapping of sections at the top level")
    hints = get_type_hints(Config)
    for name in raw:
        if name not in hints:
            raise ConfigError(f"params: unknown section {name!r} (known: {', '.join(hints)})")
    sections = {}
    for name, cls in hints.items():
        if name not in raw:
            raise ConfigError(f"params: missing section {name}")
        sections[name] = _build_section(name, cls, raw[name])
    cfg = Config(**sections)
    _check_consistency(cfg)
    return cfg


def load_config(path: str | Path = "params.yaml", overrides: dict[str, Any] | None = None) -> Config:
    """Load and validate ``params.yaml``; ``overrides`` maps dotted keys (``"credit.mode"``) to values."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"params: file {path} not found (expected the project's params.yaml)")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        first = str(exc).splitlines()[0] if str(exc) else "invalid YAML"
        raise ConfigError(f"params: {path} is not valid YAML: {first}") from None
    for dotted, value in (overrides or {}).items():
        section, _, key = dotted.partition(".")
        if not isinstance(raw, dict) or not isinstance(raw.get(section), dict) or not key:
            raise ConfigError(f"params: override {dotted!r}: expected section.key of params.yaml")
        raw[section][key] = value
    return config_from_dict(raw)

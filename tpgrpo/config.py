"""The typed, validated configuration loaded from ``params.yaml``: the one source of what each key means.

``params.yaml`` is the one place values live, one section per concern. Each field below is declared once with
:func:`param` (meaning, unit, bounds, a note: often how the paper's GPU recipe differs); the loader checks the
bounds, and ``params.yaml``'s comments and ``docs/parameters.md`` are generated from the same metadata
(``python -m tpgrpo.config_docs``; a test checks that they are current). Loading is strict: an unknown or
missing key, or a value of the wrong type or out of range, raises :class:`ConfigError` with one line naming the
key and what is expected."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_type_hints

import yaml

from tpgrpo.config_rules import check_consistency
from tpgrpo.config_values import RANGE_TEXT, RANGES, ConfigError, build_section  # noqa: F401 - re-exported

# Keys that change how the work runs, never a number. The stages read the first four kinds and record none
# (tpgrpo.stage_params.EXECUTION_KNOBS); only orchestration reads "bookkeeping" keys. Every kind but placement
# (another device rounds differently) leaves every byte as it was (tpgrpo.comparison.runs.NEUTRAL_KEYS).
KNOB_KINDS = ("placement", "memory", "hashing", "caching", "bookkeeping")
KNOB = "An execution knob: not recorded, changing it re-runs nothing (docs/long-runs.md)"
BATCH_INPUT = "Recorded, not a mere memory knob: at some sizes batched passes round differently"  # on a CPU
SPECIAL_BOUNDS = ("reward", "completion", "steps", "children")  # reward spec, probe completion, step_list, child_counts


def param(default: Any, doc: str, unit: str = "", bounds: str | tuple[str, ...] = "", rule: str = "",
          note: str = "", knob: str = "") -> Any:
    """A params key: its code default and, written once, what it means (``doc``), its ``unit``, its ``bounds``
    (checked at load: a tuple of choices, a key of :data:`RANGES` or of :data:`SPECIAL_BOUNDS`), a cross-key
    ``rule`` (checked by :func:`tpgrpo.config_rules.check_consistency`), a ``note`` (why this value, the paper's)
    and, for a key that changes how the work runs but no number, its ``knob`` kind (one of :data:`KNOB_KINDS`)."""
    if knob not in ("", *KNOB_KINDS):
        raise ValueError(f"param knob {knob!r}: expected one of {list(KNOB_KINDS)}")
    if bounds and not isinstance(bounds, tuple) and bounds not in RANGES and bounds not in SPECIAL_BOUNDS:
        raise ValueError(f"param bounds {bounds!r}: expected choices, one of {list(RANGES)} or {SPECIAL_BOUNDS}")
    meta = {"doc": doc, "unit": unit, "bounds": bounds, "rule": rule, "note": note, "knob": knob}
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class ModelConfig:
    """The model every model stage loads (nothing is downloaded)."""

    kind: str = param("tiny", "model backend; tiny = the embedded model", bounds=("tiny", "sd3", "flux"))
    path: str = param("data/base", "local model folder in the diffusers save_pretrained layout", "path")
    device: str = param("cpu", "torch device of every model stage (cpu, cuda, cuda:1)", knob="placement",
                        note=f"{KNOB}. cuda -> cuda:1 on the same GPU kind: the same numbers; cpu <-> cuda or another "
                        "GPU kind rounds differently")
    dtype: str = param("fp32", "dtype of the weights; the step maths and log-probs always run in fp32",
                       bounds=("fp32", "bf16", "fp16"))
    resolution: int = param(0, "image side; 0 = the backend's default (tiny: its own 32; sd3/flux: 512, the "
                            "paper's)", "pixels", ">= 0")


@dataclass(frozen=True)
class TaskConfig:
    """What is trained and scored: the prompt files and the rewards (a name or a weighted sum such as
    `{geneval_soft: 1.0, pickscore: 0.5}`)."""

    train_prompts: str = param("data/prompts/compositional_train.jsonl", "JSONL of training prompt metadata "
                               "(`tpgrpo prompts` writes it)", "path")
    eval_prompts: str = param("data/prompts/compositional_eval.jsonl", "JSONL of prompts never trained on", "path")
    reward: str | dict[str, float] = param("geneval_soft", "training reward", bounds="reward",
                                           note="Continuous, so step increments d_k are rarely exactly 0")
    eval_reward: str | dict[str, float] = param(
        "geneval", "reward reported at eval; strict accuracy is that of the first component that defines one",
        bounds="reward", note="With geneval (GenEval-style rules), strict = every clause right")


@dataclass(frozen=True)
class RewardModelsConfig:
    """Local folders of the reward models (nothing is downloaded) and how they run; "" = not configured."""

    device: str = param("cpu", "torch device of the reward models (cuda on a GPU machine); they run in fp32",
                        knob="placement", note=f"{KNOB}, as model.device; with several processes, cuda and cuda:N mean "
                        "each process's own GPU")
    batch_size: int = param(32, "images per reward-model forward pass", "images", "> 0", note=f"{BATCH_INPUT} (a tiny "
                            "CLIP's pickscore: up to 9e-7), so changing it re-runs the stages that score images")
    pickscore_path: str = param("", "PickScore_v1: a CLIP save_pretrained folder (config.json + weights)", "path")
    pickscore_processor_path: str = param("", "CLIP processor folder (CLIP-ViT-H-14); \"\" = pickscore_path", "path")
    pickscore_divisor: float = param(26.0, "pickscore = 100 * cos(text, image) / divisor", bounds="> 0",
                                     note="Raw PickScore is about 21-23 (Flow-GRPO divides by 26)")
    geneval_detector_path: str = param("", "OWL-ViT / OWLv2 or any AutoModelForObjectDetection "
                                       "save_pretrained folder", "path")
    geneval_detector_threshold: float = param(0.3, "box detection threshold", "score", "[0, 1]", note="GenEval: 0.3")
    aesthetic_clip_path: str = param("", "CLIP ViT-L/14 save_pretrained folder (openai/clip-vit-large-patch14)", "path")
    aesthetic_head_path: str = param("", "LAION aesthetic MLP state dict (.pth / .safetensors, e.g. "
                                     "sac+logos+ava1-l14-linearMSE.pth)", "path")


@dataclass(frozen=True)
class RemoteRewardConfig:
    """The reward server the `remote` reward posts to (`tpgrpo serve-reward --reward NAME`)."""

    url: str = param("", "the server's scoring URL, e.g. http://127.0.0.1:8765/score; \"\" = not configured")
    timeout: float = param(120.0, "time a request may take before it counts as failed", "seconds", "> 0")
    retries: int = param(3, "retries after a failed request (unreachable, timeout, HTTP 5xx)", "attempts", ">= 0")
    backoff: float = param(1.0, "wait before the first retry; doubles with each further retry", "seconds", ">= 0")
    batch_size: int = param(64, "images per request", "images", "> 0")
    encoding: str = param("png", "image encoding in a request: png (lossless, smaller) or raw (uint8 bytes, "
                          "base64)", bounds=("png", "raw"))


@dataclass(frozen=True)
class SamplingConfig:
    """The rollout's sampler: schedule, guidance and the window of stochastic steps."""

    num_steps: int = param(10, "T, denoising steps per rollout", "steps", "> 0",
                           note="Paper: 10 for training, 40 for eval")
    shift: float = param(1.0, "schedule shift (FlowMatchEulerDiscreteScheduler)", bounds="> 0",
                         note="SD3.5-M uses 3; the tiny model was pretrained with 1")
    guidance_scale: float = param(4.5, "classifier-free guidance scale g (1 = conditional only)", bounds=">= 0",
                                  note="Paper: 4.5")
    step_kind: str = param("sde", "stochastic step: sde (Flow-GRPO, Gaussian log-prob) or cps "
                           "(coefficients-preserving, TP-GRPO's release)", bounds=("sde", "cps"))
    noise_level: float = param(0.7, "eta, the stochastic steps' noise level (the paper's alpha)", bounds=">= 0",
                               note="The paper's sweet spot was 0.7")
    window_start: int = param(0, "first stochastic step (0-based)", "step index", ">= 0")
    window_size: int = param(9, "w, stochastic (stored, trained) steps from window_start", "steps", ">= 0",
                             rule="at least 1; window_start + window_size <= num_steps, and <= num_steps - 1 "
                             "for sde (an sde last step leaves noise in the final latent; cps may reach it)",
                             note="At 9 of 10: steps 0..8 stochastic, step 9 ODE (the paper's default)")


@dataclass(frozen=True)
class RolloutConfig:
    """How many samples an iteration draws."""

    prompts_per_iter: int = param(8, "prompt groups per iteration", "prompts", "> 0",
                                  note="Paper: 48 per GPU step across 32 GPUs")
    group_size: int = param(8, "G, samples per prompt", "samples", "> 0", rule=">= 2 (GRPO needs a group)",
                            note="Paper: 24")
    batch_size: int = param(64, "images per forward pass; also cuts eval's chunks (eval_prompts' files)", "images",
                            "> 0", note=f"{BATCH_INPUT} (1 vs 8: stored states up to 7e-5 apart), so changing it "
                            "re-runs the rollout, every eval and all that follows")


@dataclass(frozen=True)
class TreeConfig:
    """ODE-anchored tree rollouts instead of chains (docs/tree.md); listed as an input only while enabled."""

    enabled: bool = param(False, "sample ODE-anchored trees (every node's Q is a leaf's reward, no probe pass) "
                          "instead of G chains", note="Off, the other tree keys are inert: editing them re-runs "
                          "nothing. A tree ignores rollout.group_size and the sampling window: its samples are the "
                          "leaves, roots x (children + 1)^(split steps) per prompt")
    split_steps: str = param("0,3,6", "the schedule steps where every node spawns one ODE and `children` SDE "
                             "children (comma-separated, increasing)", "step indices", bounds="steps",
                             rule="each in [0, sampling.num_steps - 2]")
    children: int | str = param(1, "m, SDE children per node at each split step: one count for every split, or one "
                                "per split step (comma-separated: 3,1)", "children", bounds="children",
                                rule="each > 0; one count, or as many as tree.split_steps")
    roots: int = param(1, "R, independent roots (initial noises) per prompt", "roots", "> 0")
    baseline: str = param("ode_sibling", "tree advantages: ode_sibling (step reward minus the ODE sibling's, centred "
                          "per depth: mean 0) or depth_group (the earlier rule; docs/tree.md)",
                          bounds=("ode_sibling", "depth_group"), note="Read by credit only; global_std: depth_group only")


@dataclass(frozen=True)
class ProbeConfig:
    """How the probe scores the state before each window step (Q_k)."""

    batch_size: int = param(128, "states per forward pass during ODE completion", "states", "> 0",
                            note=f"{BATCH_INPUT} (3 vs 8 at 2 threads: probe rewards up to 2.6e-3 apart), so "
                            "changing it re-runs the probe and all that follows")
    completion: str = param(
        "exact", "how Q_k is scored: exact (ODE to the schedule's end), ode:M (at most M Euler steps, re-spaced; "
        "DenseGRPO's 1 or 2), grid:M (Euler steps to the next node of one coarse grid of M steps, then along its "
        "nodes, shared by every state), heun:M (M Heun steps, re-spaced), heun-grid:M (Heun steps along grid:M's path) "
        "or x0 (z_k - s_k v_k from the rollout's velocity: no transformer pass). Each transformer mode's first step "
        "reuses the stored velocity", bounds="completion", note="Under credit.mode flow_grpo the probe loads no model")


@dataclass(frozen=True)
class CreditConfig:
    """Credit: a pure function of the probe table (re-run offline for every mode in seconds)."""

    mode: str = param("tp", "tp (TP-GRPO: turning points take the aggregated reward), tp_unconstrained (without "
                      "the consistency condition), incremental (d_k on every step) or flow_grpo (R_fin on every "
                      "step)", bounds=("tp", "tp_unconstrained", "incremental", "flow_grpo"))
    balance: str = param("group", "turning-point sign balancing inside each prompt group (group) or none",
                         bounds=("group", "none"))
    global_std: bool = param(False, "divide advantages by the std over the whole iteration (per step) instead "
                             "of the prompt group's")
    adv_clip: float = param(5.0, "advantage clip: [-adv_clip, adv_clip]", "standard deviations", "> 0", note="Paper: 5")


@dataclass(frozen=True)
class UpdateConfig:
    """The LoRA policy step on the iteration's stored trajectories and advantages."""

    lora_rank: int = param(16, "LoRA rank r on the attention projections", bounds="> 0",
                           note="Paper (SD3): 32; the tiny model has 3.5M parameters")
    lora_alpha: int = param(32, "LoRA alpha (the adapter's scale is alpha / r)", bounds="> 0",
                            note="A scale of 2 as the paper's 64 / 32")
    lr: float = param(3e-4, "AdamW learning rate", bounds="> 0",
                      note="Paper: 3e-4, as every public LoRA GRPO config; at 1e-3 trees unlearned (docs/tree.md)")
    weight_decay: float = param(1e-4, "AdamW weight decay", bounds=">= 0", note="Paper: 1e-4")
    clip_range: float = param(1e-4, "PPO ratio clip eps", bounds="> 0",
                              note="Paper: 1e-4 sde / 1e-5 cps, too tight to move a policy in a few steps")
    kl_beta: float = param(0.0, "weight of the KL to the adapter-disabled reference (0 = off)", bounds=">= 0",
                           note="Its scale: KL = mean((mean - mean_ref)^2) / (2 std^2), std = eta sqrt(s/(1-s)) without "
                           "sqrt(-dt), for sde and cps alike: the release's scale, so its 1e-4 carries over")
    optimizer_steps_per_iter: int = param(2, "optimizer steps per iteration (gradient accumulation)", "steps",
                                          "> 0", rule="a multiple of update.epochs", note="Paper: 2")
    epochs: int = param(1, "passes over the iteration's transitions (reshuffled each); the optimizer steps are "
                        "split evenly over them", "passes", "> 0")
    min_transitions_per_step: int = param(
        100, "the fewest trained transitions an optimizer step is fitted to: M transitions take min(steps per "
        "pass, max(1, M // this)) steps", "transitions", "> 0", note="A chain's 432-576 keep 4, a tree's ~50 take 1")
    micro_batch: int = param(32, "transitions per backward pass", "transitions", "> 0",
                             note="Recorded (a change re-runs the updates): the same mean gradient summed in another "
                             "order, which AdamW's per-weight step amplifies (shipped model, 8 vs 1: 1.9e-3 apart)")
    max_grad_norm: float = param(1.0, "gradient-norm clip", bounds="> 0", note="Paper: 1.0")
    ema: bool = param(False, "keep an EMA of the LoRA weights for eval and export")
    gradient_checkpointing: bool = param(False, "recompute transformer blocks in backward: less memory, about "
                                         "30% slower", note=f"SD3.5 / FLUX at 512 px on one GPU. {KNOB}; the adapter "
                                         "byte-identical at equal thread counts (CPU)", knob="memory")
    objective: str = param(
        "grpo", "the update's objective: grpo (PPO-clip on the stored SDE transitions' log-probs), nft "
        "(DiffusionNFT) or awm (Advantage Weighted Matching), both on forward noisings of the clean samples, with "
        "the same credit tables (docs/objectives.md)", bounds=("grpo", "nft", "awm"),
        note="nft and awm keep a slow adapter in policy/slow (NFT's old policy, which also samples; AWM's EMA)")
    nft_beta: float = param(1.0, "nft: b, the implicit policies' step v+- = v_old +- b (v - v_old)", bounds="> 0",
                            note="Paper: 1 (0.1 for OCR)")
    nft_decay_rate: float = param(0.001, "nft: the old adapter becomes d old + (1 - d) current after each update, d = "
                                  "min(this x optimizer steps so far, update.nft_decay_max)", "per step", ">= 0",
                                  note="Paper: 0.001")
    nft_decay_max: float = param(0.5, "nft: the cap of that decay d", bounds="[0, 1]", note="Paper: 0.5")
    nft_kl: float = param(1e-4, "nft: weight of mean (v - v_base)^2, v_base the adapter-disabled model", bounds=">= 0",
                          note="Paper: 1e-4")
    nft_levels: int = param(9, "nft: noise levels per clean sample, a random subset of the schedule's step levels "
                            "(fresh noise each)", "levels", "> 0", note="Paper: 9 of 10")
    awm_p: float = param(0.25, "awm: p of the surrogate log-prob -(t/p) ell^p, ell the flow-matching error",
                         bounds="> 0", note="Paper: 0.25")
    awm_kl: float = param(1e-3, "awm: weight of mean (v - v_base)^2, v_base the adapter-disabled model", bounds=">= 0",
                          note="Paper: 0.001 for GenEval")
    awm_ema_weight: float = param(1.0, "awm: weight of mean (v - v_ema)^2, v_ema the slow EMA adapter", bounds=">= 0",
                                  note="Paper: 1.0")
    awm_ema_decay_rate: float = param(0.001, "awm: after each optimizer step the EMA becomes d ema + (1 - d) current, "
                                      "d = min(this x optimizer steps so far, update.awm_ema_decay_max)", "per step",
                                      ">= 0", note="Paper: 0.001")
    awm_ema_decay_max: float = param(0.3, "awm: the cap of that decay d", bounds="[0, 1]", note="Paper: 0.3")
    awm_levels: int = param(6, "awm: noise levels per clean sample, a random subset of the schedule's step levels "
                            "without t = 1 and the two lowest", "levels", "> 0", note="Paper: 6 of 14")
    split_levels: bool = param(False, "nft / awm on a tree: train each SDE edge's leaf only at noise levels at or "
                               "below its split's (false: at every level)", note="TP's step credit localised to "
                               "the steps it measured (docs/objectives.md)")


@dataclass(frozen=True)
class EvalConfig:
    """Held-out evaluation: ODE samples of the eval prompts at the same seeds in every iteration."""

    every: int = param(1, "evaluate after every N-th iteration (0 = never)", "iterations", ">= 0", note="An eval draws "
                       "num_prompts x samples_per_prompt images: 216 take about 50 s on 2 cores")
    num_steps: int = param(40, "ODE steps at eval", "steps", "> 0",
                           note="Paper: 40. The default run uses 20 on 2 CPU cores: eval was half its compute")
    guidance_scale: float = param(4.5, "classifier-free guidance scale of eval's samples (and the baseline's, the "
                                  "before/after figure's, report-base's), whatever the rollout's "
                                  "sampling.guidance_scale", bounds=">= 0", note="Paper: 4.5. The default run samples "
                                  "its rollouts without guidance (DiffusionNFT's setting) and evaluates with it")
    num_prompts: int = param(32, "held-out prompts evaluated (the first N of task.eval_prompts)", "prompts",
                             "> 0", note="The shipped eval file has 108")
    samples_per_prompt: int = param(2, "seeds per prompt, fixed over iterations (paired comparison)", "samples", "> 0")
    seed: int = param(0, "eval seeds derive from this, not train.seed: runs with other train seeds are scored "
                      "on the same noise", bounds=">= 0")


@dataclass(frozen=True)
class TrainConfig:
    """The run: its length, its seed and how finished iterations are sealed."""

    iterations: int = param(4, "RL iterations `tpgrpo run` / `dvc repro` trains", "iterations", "> 0")
    seed: int = param(0, "run seed: each sample's seed derives from (seed, iteration, prompt, sample)", bounds=">= 0")
    block_size: int = param(25, "finished iterations recorded as ONE sealed DVC stage per block of this many "
                            "(their five stages per iteration leave dvc.yaml); 0 = never seal", "iterations",
                            ">= 0", note="Keeps DVC's work bounded at 1,000 iterations; a param change a sealed "
                            "block read unseals it first (exact re-runs)", knob="bookkeeping")


@dataclass(frozen=True)
class RetentionConfig:
    """What `tpgrpo retain` keeps of sealed blocks (tables and metrics: always, all). Never changes an
    artifact; no stage reads it."""

    keep_trajectories: int = param(0, "trajectories.zarr + prompt embeddings of the last k finished iterations "
                                   "(0 = keep all)", "iterations", ">= 0", knob="bookkeeping")
    keep_adapter_every: int = param(0, "policy adapters of every m-th iteration, plus each block's last "
                                    "(0 = keep all)", "iterations", ">= 0", knob="bookkeeping")


@dataclass(frozen=True)
class LaunchConfig:
    """How the model stages (rollout, probe, update, eval, baseline) start their processes: dvc.yaml runs
    `tpgrpo stage NAME`, which starts them (tpgrpo.pipeline.execution.launch). Never changes an artifact or
    dvc.yaml: no stage declares these params, so changing them re-runs nothing (docs/cluster.md)."""

    launcher: str = param("accelerate", "how several processes start: accelerate (`accelerate launch`, one "
                          "machine or launch.config_file), torchrun (one machine, c10d rendezvous) or slurm "
                          "(`srun` + torchrun on every node of the SLURM allocation `tpgrpo run` runs in)",
                          bounds=("accelerate", "torchrun", "slurm"))
    num_processes: int = param(1, "processes per machine (one per GPU); 1 with accelerate or torchrun = plain "
                               "`tpgrpo stage`, no launcher; 0 = SLURM_GPUS_ON_NODE", "processes", ">= 0",
                               rule="> 0 unless launch.launcher is slurm; 1 when launch.config_file is set")
    num_nodes: int = param(0, "nodes of the SLURM allocation a stage runs on (slurm only); 0 = all", "nodes", ">= 0")
    config_file: str = param("", "accelerate config file (DeepSpeed, a hand-started multi-node run); it sets the "
                             "process count (accelerate only)", "path")
    timeout_s: float = param(1800.0, "time a process waits at a barrier or all-reduce before the stage fails "
                             "(a dead peer)", "seconds", "> 0")
    stage_server: bool = param(True, "on CPU (GPU too with launch.resident_model) with one process per stage (Linux), "
                               "stages fork from a server that imported torch/diffusers/transformers/peft once "
                               "(tpgrpo.pipeline.execution.stage_server); false = no server", knob="bookkeeping")
    resident_model: bool = param(False, "the stage server loads the base model once, on the CPU, for the stages "
                                 "to fork with (tpgrpo.models.resident); with model.device cuda it also starts "
                                 "the server for GPU stages, each of which moves its forked copy to the GPU (not "
                                 "yet run on a GPU); false = each stage loads it", knob="bookkeeping")
    hash_while_writing: bool = param(True, "the rollout takes the md5 of each trajectory-store file while writing it "
                                     "and hands it to DVC's state database, so `dvc repro` does not read the store "
                                     "again to hash it (tpgrpo.io.dvc_prehash); false = DVC hashes it", knob="hashing")
    cache_while_writing: bool = param(True, "with hash_while_writing, the rollout also writes each trajectory-store "
                                      "file into DVC's cache under its md5, so `dvc repro` does not copy the store "
                                      "there (tpgrpo.io.dvc_prehash); false = DVC copies it", knob="caching")


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    reward_models: RewardModelsConfig = field(default_factory=RewardModelsConfig)
    remote_reward: RemoteRewardConfig = field(default_factory=RemoteRewardConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    tree: TreeConfig = field(default_factory=TreeConfig)
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


def param_fields() -> dict[str, dataclasses.Field]:
    """Every params key, ``"section.key"`` -> its dataclass field (metadata: doc, unit, bounds, rule, note)."""
    return {f"{section.name}.{f.name}": f for section in dataclasses.fields(Config)
            for f in dataclasses.fields(get_type_hints(Config)[section.name])}


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
            raise ConfigError(f"params: missing section {name} (its keys and defaults: docs/parameters.md)")
        sections[name] = build_section(name, cls, raw[name])
    cfg = Config(**sections)
    check_consistency(cfg)
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

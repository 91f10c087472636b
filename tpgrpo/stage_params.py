"""What each stage reads from params.yaml, and the names stage code and orchestration share.

Stage-side facts, kept out of :mod:`tpgrpo.pipeline` so that stage code (which records the params it read in
its artifacts' ``config_hash``) does not import the orchestration that renders ``dvc.yaml`` from them.
"""

from __future__ import annotations

REWARD_PARAMS = ["reward_models", "remote_reward"]  # read by every stage that scores images

# The params each stage reads (DVC re-runs a stage when one of these changes). No stage lists `launch`, and
# dvc.yaml's commands do not carry it: the process count never changes an artifact (nor the config hash
# artifacts carry); `tpgrpo stage` reads it when it starts (tpgrpo.pipeline.launch).
STAGE_PARAMS = {
    "rollout": ["model", "task.train_prompts", "task.reward", "sampling", "rollout", "probe.completion",
                "update.lora_rank", "update.lora_alpha", "train.seed", *REWARD_PARAMS],
    "probe": ["model", "probe", "credit.mode", "update.lora_rank", "update.lora_alpha", "train.seed",
              *REWARD_PARAMS],
    "credit": ["credit"],
    "update": ["model", "update", "train.seed"],
    "eval": ["model", "task", "sampling", "eval", "rollout.batch_size", "update.lora_rank",
             "update.lora_alpha", "update.ema", "train.seed", *REWARD_PARAMS],
    # The held-out prompts' embeddings, once per run (tpgrpo.policy.eval_embeds): the chunks eval encodes.
    "eval_prompts": ["model", "task.eval_prompts", "eval.num_prompts", "eval.samples_per_prompt",
                     "rollout.batch_size"],
    "baseline": ["model", "task", "sampling", "eval", "rollout.batch_size", "update.lora_rank",
                 "update.lora_alpha", *REWARD_PARAMS],
    "summary": ["model", "task.eval_prompts", "sampling", "eval", "rollout.batch_size", "update.lora_rank",
                "update.lora_alpha", "credit.mode", "train.iterations"],
}
STAGE_LOGS = ("rollout", "probe", "credit", "update", "eval")  # each writes data/iters/NNNN/<stage>.json
# Stages that run on the processes the launch params ask for; credit and summary stay single.
MULTI_PROCESS_STAGES = ("rollout", "probe", "update", "eval", "baseline")
GLANCE = ("held_out", "strict", "train_reward", "tp_rate", "approx_kl_x1e6", "seconds_per_iter")  # dvc metrics

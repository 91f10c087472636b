"""How good the base model is, and how much signal TP-GRPO's step credit gets from it.

``tpgrpo report-base`` writes ``data/reports/base_report.{json,md}`` and ``base_grid.png``:
- held-out strict accuracy and mean reward at eval's settings (``eval.*``, its guidance included: the numbers
  the baseline stage reports), with strict accuracy per prompt kind;
- mean reward and strict accuracy on every held-out prompt, ODE sampling at 10 and 40 steps (eval's guidance),
  for every task the base was pretrained on (``pretrain.json``; older bases without it: every task);
- on base-model SDE trajectories (the rollout's sampler), the fraction of step increments ``d_k`` that
  are exactly zero under each reward, and the turning-point rate of the ``tp`` credit mode.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from tpgrpo.config import Config
from tpgrpo.tasks.clauses import clause_markdown

TASK_REWARDS = {"compositional": ("geneval", "geneval_soft"), "text": ("ocr",)}


def pretrained_tasks(model_dir: Path) -> tuple[str, ...]:
    """The tasks a base was pretrained on (its ``pretrain.json``), or every task when it does not say."""
    info = model_dir / "pretrain.json"
    if info.exists():
        tasks = json.loads(info.read_text()).get("hparams", {}).get("tasks")
        if tasks:
            return tuple(t for t in TASK_REWARDS if t in tasks)
    return tuple(TASK_REWARDS)


def eval_settings_row(backend, cfg: Config, prompts_dir: Path) -> dict:
    """Held-out reward and strict accuracy exactly as the baseline eval stage samples and scores them."""
    from tpgrpo.policy.generate import evaluate_prompts
    from tpgrpo.stage_common import resolve
    from tpgrpo.tasks.clauses import clause_table
    from tpgrpo.tasks.prompts import load_prompts

    metas = load_prompts(resolve(prompts_dir.parent.parent, cfg.task.eval_prompts))[:cfg.eval.num_prompts]
    out = evaluate_prompts(backend, metas, cfg.task.eval_reward, num_steps=cfg.eval.num_steps,
                           seed=cfg.eval.seed, guidance_scale=cfg.eval.guidance_scale,
                           shift=cfg.sampling.shift, batch_size=cfg.rollout.batch_size,
                           samples_per_prompt=cfg.eval.samples_per_prompt, return_images=True)
    images = out.pop("images")
    row = {"prompts": len(metas), "samples_per_prompt": cfg.eval.samples_per_prompt, **out}
    if all(m.get("task") == "compositional" for m in metas):  # which clause the wrong images break
        row["clauses"] = clause_table(images, [m for m in metas for _ in range(cfg.eval.samples_per_prompt)])
    return row


def ode_table(backend, cfg: Config, prompts_dir: Path, steps=(10, 40),
              tasks: tuple[str, ...] = tuple(TASK_REWARDS)) -> list[dict]:
    """One row per (task, reward, steps): mean reward and strict accuracy on all held-out prompts."""
    from tpgrpo.policy.generate import evaluation_seeds, sample_ode
    from tpgrpo.tasks.prompts import load_prompts
    from tpgrpo.tasks.rewards import get_reward

    rows = []
    for task in tasks:
        rewards = TASK_REWARDS[task]
        metas = load_prompts(prompts_dir / f"{task}_eval.jsonl")
        for num_steps in steps:
            images = sample_ode(backend, [m["prompt"] for m in metas], evaluation_seeds(cfg.eval.seed, metas),
                                num_steps=num_steps, guidance_scale=cfg.eval.guidance_scale,
                                shift=cfg.sampling.shift)
            for name in rewards:
                scored = get_reward(name)(images, metas)
                rows.append({"task": task, "reward": name, "steps": num_steps, "prompts": len(metas),
                             "mean_reward": float(scored.reward.mean()),
                             "strict_accuracy": float(scored.strict.mean())})
    return rows


def increment_table(backend, cfg: Config, prompts_dir: Path, prompts: int = 8,
                    tasks: tuple[str, ...] = tuple(TASK_REWARDS)) -> list[dict]:
    """Zero-increment fraction and turning-point rate on base-model SDE trajectories, per reward.

    ``prompts`` training prompts per task x ``rollout.group_size`` samples, sampled and probed exactly as
    the rollout and probe stages do (same sampler, ODE completion of every window state).
    """
    from tpgrpo.algo.credit import compute_credit
    from tpgrpo.policy.loading import sampler_spec
    from tpgrpo.algo.seeds import sample_seed
    from tpgrpo.tasks.prompts import load_prompts
    from tpgrpo.tasks.rewards import get_reward
    from tpgrpo.algo.trajectory import complete_window_states, rollout

    spec, G, rows = sampler_spec(cfg), cfg.rollout.group_size, []
    for task in tasks:
        rewards = TASK_REWARDS[task]
        metas = load_prompts(prompts_dir / f"{task}_train.jsonl")
        metas = [metas[i] for i in np.random.default_rng(0).choice(len(metas), prompts, replace=False)]
        index = torch.arange(len(metas)).repeat_interleave(G)
        embeds = backend.encode_prompts([m["prompt"] for m in metas]).select(index)
        seeds = [sample_seed(cfg.train.seed, 0, metas[p]["id"], g, "base-report") for p, g in
                 zip(index.tolist(), list(range(G)) * len(metas))]
        traj = rollout(backend, embeds, seeds, spec)
        N, K = traj.log_probs.shape
        finals, _ = complete_window_states(backend, traj.states, embeds, spec.sigmas, spec.window_start,
                                           spec.guidance_scale, cfg.probe.batch_size)
        images = np.concatenate([backend.decode(finals).reshape(N, K, *traj.final.shape[2:], 3),
                                 backend.decode(traj.final)[:, None]], axis=1)
        for name in rewards:
            q = get_reward(name)(images.reshape(N * (K + 1), *images.shape[2:]),
                                 [metas[p] for p in index.tolist() for _ in range(K + 1)]).reward
            credit = compute_credit(torch.tensor(q.reshape(N, K + 1)), index, mode="tp", balance="group")
            d = credit.incremental.numpy()
            rows.append({"task": task, "reward": name, "trajectories": N, "window_steps": K,
                         "zero_increment_fraction": float((d == 0).mean()),
                         "zero_increment_first_step": float((d[:, 0] == 0).mean()),
                         "zero_increment_last_step": float((d[:, -1] == 0).mean()),
                         "turning_point_rate": float(credit.turning_point.float().mean()),
                         "reward_variance_within_groups": float(np.mean(
                             [q.reshape(N, K + 1)[index == p, K].var() for p in range(len(metas))]))})
    return rows


def markdown(ode_rows: list[dict], inc_rows: list[dict], source: str, eval_row: dict | None = None) -> str:
    lines = []
    if eval_row is not None:
        kinds = ", ".join(f"{k} {v['strict_accuracy']:.3f}" for k, v in eval_row["per_kind"].items())
        lines += [f"At eval's settings ({eval_row['prompts']} held-out prompts x {eval_row['samples_per_prompt']} "
                  f"seeds, {eval_row['num_steps']} ODE steps, guidance {eval_row['guidance_scale']}): "
                  f"`{eval_row['reward_name']}` {eval_row['reward_mean']:.3f}, strict accuracy "
                  f"**{eval_row['strict_accuracy']:.3f}** (by kind: {kinds}).", ""]
        if "clauses" in eval_row:
            lines += ["The share of those images breaking each clause (`tpgrpo.tasks.clauses`):", "",
                      clause_markdown(eval_row["clauses"])]
    lines += [f"Base model `{source}`, held-out prompts, ODE sampling, one seed per prompt:", "",
             "| task | reward | steps | prompts | mean reward | strict accuracy |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['task']} | {r['reward']} | {r['steps']} | {r['prompts']} | {r['mean_reward']:.3f} | "
              f"{r['strict_accuracy']:.3f} |" for r in ode_rows]
    lines += ["", "Base-model SDE trajectories (the rollout's sampler), exact ODE completion of every window state:",
              "", "| task | reward | trajectories | zero d_k (all / first / last step) | turning-point rate (tp) |",
              "|---|---|---|---|---|"]
    lines += [f"| {r['task']} | {r['reward']} | {r['trajectories']} | {r['zero_increment_fraction']:.2f} / "
              f"{r['zero_increment_first_step']:.2f} / {r['zero_increment_last_step']:.2f} | "
              f"{r['turning_point_rate']:.3f} |" for r in inc_rows]
    return "\n".join(lines) + "\n"


def write_base_report(cfg: Config, root: Path, out_dir: Path) -> dict:
    """Evaluate the base model named in params and write the report files; returns the JSON payload."""
    from tpgrpo.io.artifacts import atomic_path, write_json
    from tpgrpo.models import load_backend
    from tpgrpo.stage_common import resolve
    from tpgrpo.policy.generate import sample_ode, save_grid
    from tpgrpo.tasks.prompts import load_prompts

    model_dir = resolve(root, cfg.model.path)
    backend = load_backend(cfg.model.kind, model_dir, cfg.model.device, cfg.model.dtype)
    prompts_dir = root / "data" / "prompts"
    tasks = pretrained_tasks(model_dir)
    payload = {"model": cfg.model.path, "tasks": list(tasks), "eval": eval_settings_row(backend, cfg, prompts_dir),
               "ode": ode_table(backend, cfg, prompts_dir, tasks=tasks),
               "increments": increment_table(backend, cfg, prompts_dir, tasks=tasks)}
    write_json(out_dir / "base_report.json", payload)
    with atomic_path(out_dir / "base_report.md") as tmp:
        tmp.write_text(markdown(payload["ode"], payload["increments"], cfg.model.path, payload["eval"]))
    grid_metas = load_prompts(prompts_dir / "compositional_eval.jsonl")[:12]
    if "text" in tasks:
        grid_metas += load_prompts(prompts_dir / "text_eval.jsonl")[:4]
    images = sample_ode(backend, [m["prompt"] for m in grid_metas for _ in range(4)],
                        list(range(len(grid_metas) * 4)), num_steps=40,
                        guidance_scale=cfg.eval.guidance_scale, shift=cfg.sampling.shift)
    save_grid(images, out_dir / "base_grid.png", ncol=8, upscale=4)
    (out_dir / "base_grid_prompts.txt").write_text(
        "Rows of the grid, two prompts per row (4 seeds each):\n" + "\n".join(m["prompt"] for m in grid_metas) + "\n")
    print(json.dumps(payload, indent=1))
    return payload

"""The method section of the comparison's reports: how every number in them is computed."""

from __future__ import annotations

from tpgrpo.comparison.results import LEVEL, N_BOOT


def method_text(n_boot: int = N_BOOT) -> str:
    """The report's method section (how every number is computed)."""
    return f"""\
- **Paired difference A - B** (held-out reward under `task.eval_reward`; strict accuracy alike): for the
  training seeds both variants have, each run's per-image table `eval.parquet` (one row per held-out prompt
  x eval seed; every run uses the same eval seeds) at the compared iteration; per image the mean over the
  training seeds of A minus that of B; the mean over images, and a {LEVEL:.0%} percentile interval from
  {n_boot:,} bootstrap resamples of whole prompts (each with all its eval seeds), `tpgrpo.comparison.stats.paired_bootstrap`.
  That interval covers prompt and eval-noise sampling for these training seeds only.
- **Over seeds and prompts** (the verdicts' interval, `tpgrpo.comparison.stats.seed_prompt_t_interval`): seed s
  of A paired with seed s of B; the mean difference +- sqrt(t_(S-1)^2 var_s / S + t_(P-1)^2 var_p / P), var_s
  the variance of the S per-seed mean differences and var_p that of the P per-prompt ones (Banerjee's
  interval for a sum of two variance estimates: t quantiles for few seeds, 4.30 at S = 3, and no degrees of
  freedom to estimate). Simulated under no true difference (seed effect sd 0.02, 20 prompts x 4 images,
  image noise sd 0.05, 4,000 draws) it excludes 0 in 4.4% of draws at 3 seeds and 3.9% at 5
  (tests/test_comparison_intervals.py), where the percentile bootstrap over seeds and prompts that it
  replaced (`seed_prompt_bootstrap`, still in the pairs CSV as `reward_boot_lo/hi`) excluded it in 18.8% at
  3 seeds and 12.5% at 5 (bench/compare_intervals.py, 1,000 draws): a claim's note says where that
  bootstrap's verdict differed.
- **Iteration**: both at the last iteration evaluated in every run of both within the iteration budget.
  **Equal wall**: A at that iteration i, B (flow_grpo, given extra iterations by the equal-wall pass) at its
  evaluated iteration nearest i x (A's / B's mean training seconds per iteration over the budget): the rate
  the pass planned with, not the seconds B's extra iterations recorded (those depend on what else shared
  the machine then). Only the seeds whose B runs the pass extended take part (the pairs table lists them).
  An equal-wall pair is never read reversed (B - A would give A the extra iterations).
  **Equal wall, loading out**: the same with each side's seconds less its model loads (rollout, update, and
  a probe that ran the model: 3 per tp iteration, 2 per flow_grpo iteration) x the measured seconds of one
  load (`tpgrpo compare load-cost`, stated in each section).
- **Training seconds**: the sum of the rollout, probe, credit and update stages' own `wall_seconds` (eval and
  process start-up left out), cumulated over iterations; measured while the runs shared the machine as the
  recorded command lines say (jobs x threads).
- **How soon each mode reaches Flow-GRPO's best** (the paper: TP-GRPO reaches Flow-GRPO's final reward in
  about a third of the steps): the target is flow_grpo's best held-out reward within the budget (mean over
  its seeds, at evaluated iterations); per mode the iteration at which its mean-over-seeds curve first
  reaches it, linear between evaluated iterations (with eval every 6 iterations a coarse estimate; "first
  evaluated" is the evaluated iteration itself), the training seconds there (mean over seeds; with and
  without loading), and a 95% t interval over seeds of each seed's own crossing where every seed reaches it.
- **Bands** in the curves: the line is the mean over training seeds, the band their minimum to maximum.
- **Verdict** of a claim "A beats B" from the interval of A - B over seeds and prompts (the prompt-only
  interval's verdict is in the note where it differs): *confirmed* if it excludes 0 on A's side,
  *refuted* if it excludes 0 on B's side, else *not detectable*; from one training seed an excluded 0 is
  only *one seed: a hint* (for or against: that interval has no seed variance in it); *not run* where the
  runs are missing or the reference does not have the paper's setting.
- **Best learning rate** (with a sweep): per mode the rate with the highest training reward (rollout mean
  over its last 3 iterations, mean over seeds), so the held-out set is not used to pick it. With a sweep
  the claims table repeats the TP-vs-Flow-GRPO claims with each mode at its best rate (at equal wall clock
  when that Flow-GRPO variant was given the extra iterations): Flow-GRPO copies the final reward to every
  window step, so one learning rate gives it a stronger update than per-step credit gets.
"""

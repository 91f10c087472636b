"""The cross-key rules of the params (each field's ``rule`` in :mod:`tpgrpo.config`): checked once every section
has loaded and passed its own key checks. Split out of ``tpgrpo.config``, which declares the sections."""

from __future__ import annotations

from tpgrpo.config_values import ConfigError


def check_consistency(cfg) -> None:
    """ConfigError (one line) unless the keys of ``cfg`` (a :class:`tpgrpo.config.Config`; not imported here: it
    imports this module) that constrain one another agree (each field's ``rule``)."""
    if cfg.launch.num_processes == 0 and cfg.launch.launcher != "slurm":
        raise ConfigError(f"params: launch.num_processes = 0 with launch.launcher = {cfg.launch.launcher}: expected "
                          "a value > 0 (0 = SLURM's GPUs per node, launch.launcher slurm only)")
    if cfg.launch.config_file and cfg.launch.launcher != "accelerate":
        raise ConfigError(f"params: launch.config_file = {cfg.launch.config_file!r} with launch.launcher = "
                          f"{cfg.launch.launcher}: expected launch.launcher accelerate (an accelerate config file)")
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
        # cps is deterministic there (its noise is s_{k+1} sin(.) = 0), so it may reach the end; the
        # update leaves that step out of the PPO term (no policy: select_transitions).
        raise ConfigError(
            f"params: sampling.window_start + sampling.window_size = {s.window_start + s.window_size} with "
            f"sampling.step_kind = sde: expected <= {s.num_steps - 1} (sampling.num_steps - 1; an sde step "
            "at the last step puts noise into the final latent; cps may reach it)")
    if cfg.tree.enabled:  # off, the tree keys are inert: not checked against the schedule either
        from tpgrpo.algo.tree_shape import check_tree_params

        check_tree_params(cfg)
    u = cfg.update
    if u.optimizer_steps_per_iter % u.epochs:
        raise ConfigError(
            f"params: update.optimizer_steps_per_iter = {u.optimizer_steps_per_iter}: expected a multiple of "
            f"update.epochs ({u.epochs}), the steps are split evenly over the passes")
    if cfg.rollout.group_size < 2:
        raise ConfigError(
            f"params: rollout.group_size = {cfg.rollout.group_size}: expected >= 2 (GRPO needs a group)")

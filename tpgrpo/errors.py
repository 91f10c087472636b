"""Errors a user can act on; the CLI prints them as one line and exits non-zero."""


class ConfigError(ValueError):
    """A bad ``params.yaml``: the message names the key and what is expected."""


class PipelineError(RuntimeError):
    """A stage cannot run: missing input artifact, out-of-order stage, non-finite values, ..."""


class ArtifactError(PipelineError, ValueError):
    """An artifact (or input file) that is unreadable or does not follow its schema."""


class RewardError(PipelineError):
    """A reward cannot score: its model does not load, its server is unreachable or replies garbage."""

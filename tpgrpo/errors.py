"""Errors a user can act on; the CLI prints them as one line and exits non-zero."""


class PipelineError(RuntimeError):
    """A stage cannot run: missing input artifact, out-of-order stage, non-finite values, ..."""


class RewardError(PipelineError):
    """A reward cannot score: its model does not load, its server is unreachable or replies garbage."""

"""`python -m tpgrpo` and the `tpgrpo` command: the CLI, or its stage commands through the stage server.

A stage command (``tpgrpo stage ...``, ``tpgrpo block ...``: what DVC runs) goes to the stage server when
``tpgrpo run`` started one, else to :mod:`tpgrpo.pipeline.execution.stage_runner` in this process; only the other
commands load the whole CLI (which imports, for instance, the pretraining code to register its command).
"""

import sys


def main() -> None:
    """Hand a stage command to the stage server when `tpgrpo run` started one; otherwise run it here."""
    from tpgrpo.pipeline.execution.stage_client import COMMANDS, run_via_server

    code = run_via_server(sys.argv)
    if code is not None:
        sys.exit(code)
    if sys.argv[1:2] and sys.argv[1] in COMMANDS:
        from tpgrpo.pipeline.execution.stage_runner import run_guarded, runner_app

        run_guarded(runner_app)
        return
    from tpgrpo.cli import run_app

    run_app()


if __name__ == "__main__":
    main()

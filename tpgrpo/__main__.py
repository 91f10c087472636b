"""`python -m tpgrpo` and the `tpgrpo` command: the CLI, or its stage commands through the stage server."""

import sys


def main() -> None:
    """Hand a stage command to the stage server when `tpgrpo run` started one; otherwise run the CLI here."""
    from tpgrpo.pipeline.stage_client import run_via_server

    code = run_via_server(sys.argv)
    if code is not None:
        sys.exit(code)
    from tpgrpo.cli import run_app

    run_app()


if __name__ == "__main__":
    main()

"""`python -m tpgrpo` runs the CLI."""

from tpgrpo.cli import app

app()

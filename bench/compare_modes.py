"""Alias of ``tpgrpo compare`` (run | equal-wall | status | report | archive): the command older notes quote."""

if __name__ == "__main__":
    from tpgrpo.comparison.cli import app; app()  # noqa: E702

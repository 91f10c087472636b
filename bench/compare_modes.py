"""Compare the credit modes over training seeds, by iteration and by wall clock (issue 12).

A thin wrapper around :mod:`tpgrpo.comparison.cli`; see ``python bench/compare_modes.py --help``:

    python bench/compare_modes.py run --out runs/compare/soft --jobs 2 --threads 1
    python bench/compare_modes.py equal-wall --out runs/compare/soft
    python bench/compare_modes.py report --results runs/compare/soft --out docs/replication.md
"""

from tpgrpo.comparison.cli import app

if __name__ == "__main__":
    app()

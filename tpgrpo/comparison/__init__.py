"""The credit-mode comparison: paired statistics (stats), runs and their variants, results, archives,
the report and its CLI."""

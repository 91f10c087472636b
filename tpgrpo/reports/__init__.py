"""Reports: the summary's figures and plots, and the base model's report."""

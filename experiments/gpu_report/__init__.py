"""experiments.gpu_report: every GPU target of the project measured in one run (issue 23)."""

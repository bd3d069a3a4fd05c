"""Code the studies share that is no library's: NOT an entry point (report.py: a study run's
clock, log, tables, plots, results.json and summary line)."""

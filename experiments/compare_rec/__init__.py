"""Recommendation models under one budget: `python -m experiments.compare_rec` (__main__.py);
the report (summary, plot) in study.py."""

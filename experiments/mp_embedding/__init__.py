"""Mixed-precision embedding tables against fp32: `python -m experiments.mp_embedding`
(__main__.py); the runs, memory counts, hit rates and tables in study.py."""

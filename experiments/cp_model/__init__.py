"""The CP paper's latency study (arXiv 2411.01783): `python -m experiments.cp_model`.

  __main__.py   the entry point (flags -> constants -> study)
  study.py      the paper's TTFTs and Table 5, evaluation against the model, table, plots
  perf_model.py the analytic prefill latency model (rooflines, ring overlap, links)
"""

"""ScaleAcross Explorer (arXiv 2605.24326): a step-time model of LLM training across
buildings and regions (model.py), cluster files (cluster.py, clusters/), the optimizer
(search.py) and the study's table, check and plot (study.py); `python -m
experiments.scaleacross`."""

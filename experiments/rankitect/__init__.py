"""Rankitect architecture search (arXiv 2311.08430): `python -m experiments.rankitect`
(__main__.py); the shared space in space.py, the supernet in supernet.py, the methods,
trial log, Pareto fronts and plot in study.py."""

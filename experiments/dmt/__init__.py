"""DMT towers vs the flat DLRM: `python -m experiments.dmt` (__main__.py); the training
comparison, the all-to-all volume model and the plot in study.py."""

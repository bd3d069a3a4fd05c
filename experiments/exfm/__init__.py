"""ExFM external distillation: `python -m experiments.exfm` (__main__.py); the streaming
teacher / DAS / student comparison, tables and plots in study.py."""

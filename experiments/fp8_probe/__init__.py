"""FP8 dense layers in recommendation models: `python -m experiments.fp8_probe`
(__main__.py); LoKA's per-layer probe, the trained variants and step times in probe.py."""

"""RecD in-batch deduplication, plain vs dedup throughput: `python -m experiments.recd`
(__main__.py); session-grouped data, the timed comparison, its table and plot in study.py."""

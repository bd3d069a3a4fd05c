"""EAGLE speculative decoding against plain decoding (arXiv 2508.08192):
`python -m experiments.spec_decode`.

  __main__.py   the entry point (flags -> target, distilled draft head -> benchmark)
  benchmark.py  speculative vs plain decoding per tree shape: accepted length, tokens per
                target call, ms per token, speedup, greedy match; the plot
"""

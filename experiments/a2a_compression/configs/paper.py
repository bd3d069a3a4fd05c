"""Error-bounded lossy compression of the embedding all-to-all (arXiv 2407.04272) against
the float32 exchange: DLRM quality, payload bytes and the modelled H100 step speedup beside
the paper's 1.38x.

Command: XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m
  experiments.a2a_compression --config=experiments/a2a_compression/configs/paper.py
Same as: XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m
  experiments.a2a_compression
Hardware: the 2-core CPU of BENCHMARKS.md, 8 simulated devices
Time: 58 s (jax 0.11.2, 2026-12-03)
Prints: synthetic AUC baseline 0.7121, fixed 0.7157 (+0.0036), adaptive 0.7161; Criteo
  sample 0.7227 / 0.7264 (+0.0037) / 0.7253; payload 45,056 of 131,072 float32 bytes per
  device per step (2.91x; fixed-rate 2.91x, zstd 19.2x / 22.2x); modelled H100 speedup
  1.26x when the exchange is 40% of the step (paper 1.38x) (BENCHMARKS.md "Lossy compressed
  embedding all-to-all")
"""


def get_config():
  return {
      "datasets": ["synthetic", "criteo:../shared/data/criteo_kaggle_sample"],
      "steps": 300,
      "criteo_epochs": 1.0,
      "batch_size": 256,
      "num_rows": 20000,
      "a2a_mode": "abs",
      "a2a_error_bound": 0.01,
      "a2a_grad_error_bound": 0.001,
      "a2a_bits": 8,
  }

"""The embedding planner against the compiled train step: every sharding kind over the full
grid (10 table sets and batches, 60 cases), bytes moved per step and memory per device,
estimate / measured.

Command: python -m experiments.planner_check --config=experiments/planner_check/configs/full_grid.py
Same as: python -m experiments.planner_check
Hardware: the 2-core Intel Xeon CPU with 8 simulated devices
  (XLA_FLAGS=--xla_force_host_platform_device_count=8), shared (load average 3-11)
Time: 13 min 43 s wall, 449 s CPU (2026-12-02, jax 0.11.2)
Prints: bytes and memory estimate / measured 1.000 for every kind at every point (60 cases,
  within_target true); the planner before the layout terms: bytes 0.33-1.00, cw with int8
  rows memory 0.49 (BENCHMARKS.md "Planner checked against the program")
"""


def get_config():
  return {
      "planner_grid": "full",
      "sharding_kinds": ["dp", "tw", "rw", "cw", "twrw", "sptt"],
      "planner_step": "train",
  }

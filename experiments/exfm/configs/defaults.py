"""ExFM (arXiv 2502.17494): a Wukong teacher of three sizes serving DLRM and DCN-v2
students through DAS files over streaming periods; kd, auxiliary head and student adapter
against each student alone.

Command: python -m experiments.exfm --config=experiments/exfm/configs/defaults.py
  --workdir=runs/exfm
Same as: python -m experiments.exfm
Hardware: the 2-core CPU of BENCHMARKS.md, shared with other jobs (load average 24-41)
Time: 33.8 min wall, 486 s of CPU time (2026-11-27, jax 0.11.2)
Prints: student NE gain over alone (%, main teacher L, mean over periods 4-8): synthetic
  DLRM kd +2.59, aux_head +0.46, + adapter +0.43; DCN-v2 +0.65 / +0.23 / +0.26; Criteo
  sample DLRM +1.00 / -1.69 / -1.71, DCN-v2 +3.49 / +0.46 / +0.05 (BENCHMARKS.md "ExFM
  external distillation")
"""


def get_config():
  return {
      "students": 2,
      "periods": 6,
      "history": 3,
      "teacher_every": 2,
      "batch_size": 256,
      "num_rows": 500,
      "teacher_sizes": ["S", "M", "L"],
      "main_teacher": "L",
      "teacher_data": 4.0,
      "logit_scale": 3.0,
  }

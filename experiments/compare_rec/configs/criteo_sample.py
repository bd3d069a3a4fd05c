"""DLRM, DCN-v2, DHEN and Wukong under one budget on the Criteo Kaggle sample: one epoch of
the 7,200 train rows, three seeds.

Command: python -m experiments.compare_rec
  --config=experiments/compare_rec/configs/criteo_sample.py --workdir=runs/compare_rec_criteo
Same as: python -m experiments.compare_rec --data=criteo:../shared/data/criteo_kaggle_sample
  --epochs=1 --batch_size=128 --eval_batch_size=1024
Hardware: the 2-core CPU of BENCHMARKS.md
Time: 72 s wall (2026-11-21)
Prints: test AUC / NE over seeds 0, 1, 2 (800 eval rows): DLRM 0.7141 ± 0.0205 / 0.9125 ±
  0.0257, DCN-v2 0.7284 ± 0.0043 / 0.9001 ± 0.0042, DHEN 0.6663 ± 0.0360 / 0.9745 ±
  0.0292, Wukong 0.7010 ± 0.0167 / 0.9373 ± 0.0282 (BENCHMARKS.md "Every rec model on the
  Criteo Kaggle sample")
"""


def get_config():
  return {
      "data": "criteo:../shared/data/criteo_kaggle_sample",
      "epochs": 1.0,
      "batch_size": 128,
      "eval_batch_size": 1024,
      "seeds": ["0", "1", "2"],
  }

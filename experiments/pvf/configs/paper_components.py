"""PVF per parameter group (arXiv 2405.01741's definitions: SBF, MBF, MBBF) of a trained
DLRM and a Llama, with the paper's DLRM components (bottom_mlp, top_mlp, embeddings).

Command: python -m experiments.pvf --config=experiments/pvf/configs/paper_components.py
Same as: python -m experiments.pvf
Hardware: the 2-core CPU of BENCHMARKS.md, shared with six other jobs (load average 28-30)
Time: 11.9 min wall, 2.1 min CPU (2026-11-27, jax 0.11.2)
Prints: DLRM test AUC 0.7550; fp32 SBF / MBF / MBBF PVF: emb 0 / 0 / 0, top_mlp 0.0055 /
  0.0140 / 0.0160, bottom_mlp 0.0075 / 0.0140 / 0.0140, emb_read 0.0110 / 0.0235 / 0.0265;
  widest 95% Wilson half-width 0.0104 (DLRM), 0.036 (Llama) (BENCHMARKS.md "PVF: bit flips
  per parameter group")
"""


def get_config():
  return {
      "preset": "small",
      "steps": 300,
      "batch_size": 512,
      "num_rows": 20000,
      "formats": ["fp32", "bf16", "int8"],
      "faults": ["single", "multi:2", "burst:2"],
      "trials": 2000,
      "examples": 1024,
      "llama_trials": 500,
      "llama_faults": ["single"],
  }

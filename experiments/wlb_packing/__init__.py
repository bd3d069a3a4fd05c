"""WLB-LLM's packing study (arXiv 2503.17924): `python -m experiments.wlb_packing`.

  __main__.py  the entry point (flags -> cost model and StudyConfig -> study)
  study.py     Table 2 (imbalance, packing time, token delay), the CP sharding comparison,
               the table and the plot
"""

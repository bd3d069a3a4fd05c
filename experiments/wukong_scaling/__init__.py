"""Wukong's dense scaling beside DLRM and DCN-v2: `python -m experiments.wukong_scaling`
(__main__.py); grids, power-law fits, findings and the plot in study.py."""

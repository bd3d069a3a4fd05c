"""PVF of a DLRM and a Llama per parameter group: `python -m experiments.pvf` (__main__.py);
the trials through the real modules in dlrm.py and llama.py, the table and plot in
study.py."""

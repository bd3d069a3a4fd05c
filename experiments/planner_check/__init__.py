"""The embedding planner checked against the compiled program: `python -m
experiments.planner_check` (__main__.py); the grid, the build, measurement and estimate, the
table and plot in study.py."""

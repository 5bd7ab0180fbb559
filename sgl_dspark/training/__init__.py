"""Drafter training: the frozen target's features and distributions, drafter initialisation from the target,
the DSpark loss, and held-out rollouts. `python -m sgl_dspark.train` and `python -m sgl_dspark.calibrate` drive it.
"""

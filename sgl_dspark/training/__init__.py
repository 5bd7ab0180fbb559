"""Drafter training: the frozen target's features and distributions, drafter initialisation from the target,
the DSpark loss, and held-out rollouts. Commands: `python -m sgl_dspark.training.data build` (distillation data),
`python -m sgl_dspark.training.trainer`, `python -m sgl_dspark.training.calibrate` (STS temperatures) and
`python -m sgl_dspark.training.export` (a shippable drafter folder with its model card).
"""

"""The DSPARK worker inside SGLang's scheduler process: `worker` (SGLang's V2 speculative worker, one decode step as
named steps), `setup` (what it is built from, assembled once at start-up) and `profiler` (the step-cost table timed
on the running target). They drive SGLang's batches and model runner; the algorithm they run is sgl_dspark's.
"""

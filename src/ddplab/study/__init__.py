"""``ddplab study``: steps to a target versus global batch, per lr rule, many runs trained at once.

config (the grid, torch-free) · workloads · engine (the vectorized group) · grid (runs and their cache)
· analysis · fit (pure) · verify (replay on DDP ranks) · report · plots · run (the whole study).
"""

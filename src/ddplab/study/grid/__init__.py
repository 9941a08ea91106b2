"""``ddplab study``'s grid: steps to a target versus global batch, per lr rule, many runs trained at once.

training (the groups a batch needs, trained by an engine or read from the cache) · cache · analysis (the fits,
B_simple, the scorecard, the front) · verify (replay on DDP ranks) · study (the whole study, ``run_study``).
"""

"""The one-neuron sandbox: one process against DDP ranks, exactly, with the closed-form theory beside it.

config (runs and results, torch-free) · theory (pure) · data (the counter-based generator) · train ·
table (the classic nine-run study and its checked conclusions).
"""

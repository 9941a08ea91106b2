"""The critical batch where a training is (``ddplab study --branch-at/--branch-from``): short branches from its
checkpoints at larger global batches.

config (what is asked for) · checkpoint (the types the branches share) · loading (checkpoint files) · reference
(``branch_at``'s reference run) · branches (trained vectorized; on ranks: ``engines/ddp_branches.py``) · cache ·
judgement (the critical batch from the branches' losses, pure) · schedule (the batch schedule it implies, pure) ·
measurement (the whole measurement, ``measure``).
"""

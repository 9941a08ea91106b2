"""``ddplab noise -- COMMAND``: the noise scale of the user's own training command, measured by a guest.

config (the run; pure) · run (the command with the guest armed, then the merge) · merge (the ranks' records into
measured steps; pure) · report (B_simple, its interval, the curve over samples seen; pure).
"""

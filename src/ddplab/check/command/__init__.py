"""``ddplab check -- COMMAND``: the user's own command run on W ranks and in one process over one global batch, and
what each optimizer step received compared."""

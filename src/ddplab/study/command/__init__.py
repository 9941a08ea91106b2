"""``ddplab study [options] -- COMMAND``: the study of the user's own launch command, each run started by an
executor (this machine, Ray or Slurm) with placeholders filled, read by a guest in its processes."""

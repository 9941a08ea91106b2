"""``ddplab study``: two products over shared parts.

- ``grid/``: steps to a target versus global batch, per lr rule (``ddplab study``);
- ``branched/``: the critical batch from checkpoints (``--branch-at``, ``--branch-from``);

shared: config (torch-free), workloads, runs (run groups and results), orders (the samples' orders), fit (pure),
optim (stacked and torch optimizers), ``rules/`` (the lr rules, each one module), ``engines/`` (what trains runs,
with one chooser for both products), ``report/`` (records, figures, the HTML report).
"""

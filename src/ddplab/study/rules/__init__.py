"""The study's lr rules, registered by name: each one object that says how it trains and how it is read.

Adding a rule is a module with a :class:`~ddplab.study.rules.base.Rule` subclass that calls
:func:`~ddplab.study.rules.registry.register` on itself (see :mod:`ddplab.study.rules.fixed` for the simplest),
named in :data:`ddplab.study.rules.registry.BUILT_IN`, which imports it when a rule is first asked for.
:mod:`~ddplab.study.rules.sweep` is the grid's view over the rules a study asks for.
"""

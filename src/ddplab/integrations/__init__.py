"""ddplab inside the training frameworks, one small module each (optional extras; nothing imported here).

- ``ddplab.integrations.lightning`` (``pip install ddplab[lightning]``): the ``GradientNoiseScale``,
  ``ScaleLearningRate`` and ``Audit`` callbacks.
- ``ddplab.integrations.accelerate`` (``ddplab[accelerate]``): the noise scale of a prepared model, and a
  plan for ``accelerator.num_processes`` and its gradient accumulation.
- ``ddplab.integrations.transformers`` (``ddplab[transformers]``): a ``TrainerCallback`` for the noise
  scale, and the plan for ``TrainingArguments``.
"""

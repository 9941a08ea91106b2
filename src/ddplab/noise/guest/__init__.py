"""The noise scale's guest: armed by ``ddplab noise -- COMMAND`` in every Python process of the user's command.

plan (which optimizer steps to measure, from the environment; pure) · record (each rank's own file of measured
steps; pure) · state (the process's state and its guard) · tap (one measured step: hooks that only read) ·
tokens (a language model's tokens, counted from its loss's targets) · install (the patches, armed after
``import torch``).
"""

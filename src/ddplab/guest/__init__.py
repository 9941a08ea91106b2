"""The guest layer: the mechanism that runs the user's own command with ddplab inside every Python process of it.

Below the products that plug a guest into it (the audit, ``noise -- COMMAND``, ``study -- COMMAND``,
``check -- COMMAND``): the runner that launches the command (:mod:`ddplab.guest.runner`), the bootstrap
sitecustomize that arms the guest a product names, and what every guest shares inside the user's program: the
guard that disarms a guest instead of failing its host, the import watcher, the patch record, the tensors'
fingerprints and each process's record file.
"""

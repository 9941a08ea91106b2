"""``ddplab check``: prove a spec trains the same on W DDP ranks as in one process, or say why not."""

from ddplab.check.config import CheckConfig
from ddplab.check.result import CheckResult
from ddplab.progress import Progress, silent

__all__ = ["CheckConfig", "CheckResult", "check"]


def check(config: CheckConfig, launch_config=None, progress: Progress = silent) -> CheckResult | None:
    """See :func:`ddplab.check.equivalence.check` (imports torch, after the spec's path is checked)."""
    from ddplab.runtime.spec import check_spec_path

    check_spec_path(config.spec_path)
    from ddplab.check.equivalence import check as _check

    return _check(config, launch_config, progress)

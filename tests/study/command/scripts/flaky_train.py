"""examples/padded_lm/train.py with a planted failure: ``--crash-at N`` fails every try at optimizer step N,
``--crash-once PATH`` fails at step 3 unless PATH exists (creating it), so a second try passes."""

import os
import runpy
import sys

from torch.optim.optimizer import register_optimizer_step_post_hook

EXAMPLE = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "..", "examples",
                                        "padded_lm", "train.py"))


def _take(flag: str) -> str:
    if flag not in sys.argv:
        return ""
    at = sys.argv.index(flag)
    value = sys.argv[at + 1]
    del sys.argv[at:at + 2]
    return value


crash_at, crash_once = int(_take("--crash-at") or 0), _take("--crash-once")
steps = [0]


def _maybe_fail(optimizer, args, kwargs):
    steps[0] += 1
    if steps[0] == crash_at:
        raise RuntimeError(f"planted failure at step {steps[0]}")
    if steps[0] == 3 and crash_once and not os.path.exists(crash_once):
        if os.environ.get("RANK", "0") == "0":
            open(crash_once, "w").close()
        raise RuntimeError("planted failure, once")


register_optimizer_step_post_hook(_maybe_fail)
sys.argv[0] = EXAMPLE
runpy.run_path(EXAMPLE, run_name="__main__")

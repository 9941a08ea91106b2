"""Put on PYTHONPATH: Ray's dashboard agent stalls at its first start until its raylet has given up on it, as on a
machine too loaded to start it within Ray's fixed budget; later starts (the marker file exists) are left alone."""

import os
import sys
import time

MARKER = os.environ.get("DDPLAB_TEST_SLOW_RAY_AGENT")

if MARKER and not os.path.exists(MARKER) and any(a.endswith(os.path.join("dashboard", "agent.py")) for a in sys.argv):
    open(MARKER, "w").close()
    raylet, since = os.getppid(), time.monotonic()
    while os.getppid() == raylet and time.monotonic() - since < 120:  # the raylet aborts once its wait runs out
        time.sleep(0.2)

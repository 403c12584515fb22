"""`python -m sharding.worker --model ...`: one rank > 0, launched by tpserve's launcher (or torchrun)."""

import sys
import time

STARTED = time.monotonic()  # before the imports: a respawned rank logs its whole start (sharding/runner.py)

from sharding.runner import worker_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(worker_main(started=STARTED))

"""`python -m sharding.worker --model ...`: one rank > 0, launched by tpserve's launcher (or torchrun)."""

import sys

from sharding.runner import worker_main

if __name__ == "__main__":
    sys.exit(worker_main())

"""`python -m jaxllm.bench`: batch-throughput sweep (see jaxllm.benchmarks.bench)."""

import sys

from jaxllm.benchmarks.bench import main

if __name__ == "__main__":
    sys.exit(main())

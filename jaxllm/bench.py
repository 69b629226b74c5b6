"""`python -m jaxllm.bench`: batch-throughput sweep (see jaxllm.harness.bench)."""
import sys

from jaxllm.harness.bench import main

if __name__ == "__main__":
    sys.exit(main())

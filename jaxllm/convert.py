"""`python -m jaxllm.convert`: see jaxllm/harness/convert.py."""
import sys

from jaxllm.harness.convert import main

if __name__ == "__main__":
    sys.exit(main())

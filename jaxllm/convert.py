"""`python -m jaxllm.convert`: see jaxllm/cli/convert.py."""

import sys

from jaxllm.cli.convert import main

if __name__ == "__main__":
    sys.exit(main())

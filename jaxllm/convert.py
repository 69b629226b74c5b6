"""`python -m jaxllm.convert`: see jaxllm/harness/convert.py."""
from jaxllm.harness.convert import main

if __name__ == "__main__":
    main()

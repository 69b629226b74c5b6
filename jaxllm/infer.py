"""`python -m jaxllm.infer`: see jaxllm/harness/infer.py."""
from .harness.infer import main

if __name__ == "__main__":
    main()

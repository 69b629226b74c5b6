"""`python -m jaxllm.infer`: see jaxllm/harness/infer.py."""
from jaxllm.harness.infer import main

if __name__ == "__main__":
    main()

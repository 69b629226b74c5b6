"""`python -m jaxllm.infer`: see jaxllm/cli/infer.py."""

from jaxllm.cli.infer import main

if __name__ == "__main__":
    main()

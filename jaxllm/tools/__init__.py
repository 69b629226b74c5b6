"""Tools for deployment: the TPU compile check (`python -m jaxllm.tools.tpu_compile`)."""

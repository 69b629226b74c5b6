"""The benchmarks: the fused decode loop against the device's ceilings (`python -m jaxllm.bench`)
and the server under load beside it (`python -m jaxllm.bench --serve`)."""

"""The OpenAI-compatible server: `python -m jaxllm.serve` (see `app.build_app` to embed it)."""

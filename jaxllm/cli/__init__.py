"""The command lines: generation and perplexity (`python -m jaxllm.infer`), conversion
(`python -m jaxllm.convert`), and what they share (flags, loading, one-line errors)."""

"""The only package that imports vLLM: plugin registration, version compat, the attention backend."""

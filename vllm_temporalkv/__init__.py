"""vllm-temporalkv: vector-quantized KV caches (TemporalKV and the methods it is compared with) for vLLM."""

__version__ = "0.1.0"

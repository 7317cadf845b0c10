"""Checkpoint conversion between Hugging Face Llama-family models and Megatron-Core ``torch_dist``."""

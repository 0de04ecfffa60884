"""The JAX paged Gemma engine: weights, tokenizer, forward pass, sampling."""

"""A trained draft head for speculative decoding (EAGLE-3 style): the head, its vLLM format, data and trainer."""

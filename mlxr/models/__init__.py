"""Model families. One configurable decoder covers llama, mistral, qwen2/3, gemma 1/2/3, phi3."""

"""Converters from other model formats to ordinary Hugging Face / mlx-lm model directories."""

"""Text in and out of the model: tokenizers and their file formats, chat templates, sampling
and stop sequences."""

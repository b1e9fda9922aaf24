"""Models on disk: the local store over the Hugging Face cache (`local`) and the Hub client that
fills it (`hub`: pull, search)."""

"""The errors mlxr raises for bad user input (model files, prompts, requests).

All are ValueErrors so that callers who do not care about the distinction can catch one type.
Each message names the file and the key or tensor at fault, so a user can act on it.
"""


class MlxrError(ValueError):
    """Base class for every user-facing mlxr error."""


class ModelFormatError(MlxrError):
    """A model directory, config.json or safetensors file is malformed or unsupported."""


class TokenizerError(MlxrError):
    """Tokenizer files are missing or malformed, or a chat template failed."""


class ContextLengthError(MlxrError):
    """A prompt (plus the requested tokens) does not fit the model's context."""


class MemoryBudgetError(MlxrError):
    """A model's weights plus the smallest KV pool do not fit what the memory budget leaves."""


class NotDownloadedError(MlxrError):
    """A Hub model (or alias) is not in the local cache; `mlxr pull NAME` would fetch it."""

    def __init__(self, message: str, name: str):
        super().__init__(message)
        self.name = name

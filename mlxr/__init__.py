"""mlxr: run MLX (mlx-lm / mlx-community) model files unconverted on NVIDIA GPUs and CPUs.

Reading order: model (load, generate) -> generate (one stream of events) -> models/loader
(checkpoint -> weights) -> models/decoder (the forward) -> layers -> ops (reference / kernels)
-> quant (formats) -> checkpoint (validated safetensors) -> config.
"""

from .errors import ContextLengthError, MlxrError, ModelFormatError, TokenizerError
from .model import Model, load, validate
from .text.sampling import SamplingParams

__version__ = "0.1.0"


def load_tokenizer(path):
    """Load the tokenizer of a model directory (see mlxr.text.tokenizer.Tokenizer)."""
    from .text.tokenizer import load_tokenizer as _load

    return _load(path)


__all__ = ["ContextLengthError", "MlxrError", "Model", "ModelFormatError", "SamplingParams",
           "TokenizerError", "__version__", "load", "load_tokenizer", "validate"]

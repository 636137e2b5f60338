"""superoffload_hf: SuperOffload (ASPLOS 2026) as a Hugging Face training backend."""

from superoffload_hf.config import ConfigError, SuperOffloadConfig

__all__ = ["ConfigError", "SuperOffloadConfig"]
__version__ = "0.1.0"

"""branchspec: tree speculative decoding for DeepSeek-V4-style compressed attention."""

from branchspec.config import EngineConfig, ModelConfig, SamplingParams, SpecConfig

__all__ = ["EngineConfig", "ModelConfig", "SamplingParams", "SpecConfig"]
__version__ = "0.1.0"

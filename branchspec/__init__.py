"""branchspec: tree speculative decoding for DeepSeek-V4-style compressed attention."""

from branchspec.config import EngineConfig, ModelConfig, SamplingParams, SpecConfig
from branchspec.llm import LLM, CompletionOutput, RequestOutput

__all__ = ["LLM", "CompletionOutput", "EngineConfig", "ModelConfig", "RequestOutput", "SamplingParams", "SpecConfig"]
__version__ = "0.1.0"

"""Frozen configuration dataclasses, validated at construction by one family of checks
(`checks`: ConfigTypeError for a wrong type, ConfigError for a value that cannot work,
each naming the field).

`ModelConfig` describes a V4-style model and round-trips through `config.json`.
`SpecConfig` holds SGLang's three speculative knobs, `AutoPolicy` an adaptive choice
among them. `SamplingParams` follows vLLM. `EngineConfig` sizes the batch and the pools.
"""

from branchspec.config.checks import (ConfigError, ConfigTypeError, check_bool, check_float, check_int,
                                      require)
from branchspec.config.engine import EngineConfig, check_device
from branchspec.config.model import (SCORING_FUNCS, SUPPORTED_RATIOS, Compression, ModelConfig, read_config_json,
                                     tiny_config, tiny_v4_config, v4_flash_slice_config, v4_mini_config,
                                     v4_mini_v2_config)
from branchspec.config.sampling_params import GREEDY_TEMPERATURE, MAX_N, MAX_SEED, SamplingParams
from branchspec.config.speculative import (AUTO_TREE_SHAPES, AutoPolicy, SpecConfig, default_candidates,
                                           fast_path_candidates, spec_label)

__all__ = ["ConfigError", "ConfigTypeError", "check_bool", "check_float", "check_int", "require", "EngineConfig",
           "check_device", "SCORING_FUNCS", "SUPPORTED_RATIOS", "Compression", "ModelConfig", "read_config_json",
           "tiny_config", "tiny_v4_config", "v4_flash_slice_config", "v4_mini_config", "v4_mini_v2_config",
           "GREEDY_TEMPERATURE", "MAX_N", "MAX_SEED", "SamplingParams", "AUTO_TREE_SHAPES", "AutoPolicy", "SpecConfig",
           "default_candidates", "fast_path_candidates", "spec_label"]

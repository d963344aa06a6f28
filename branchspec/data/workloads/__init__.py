"""Workloads: the prompts the tree-vs-chain study measures, and the text the models learn from.

``registry`` lists the workloads (gsm8k, mbpp, sharegpt, humaneval), each with its fixed,
disjoint splits, its source and its prompt format; one module per data source
(``gsm8k``, ``mbpp``, ``sharegpt``, ``humaneval``) loads and splits it; ``json_stream``
reads the cut-off ShareGPT file. Everything callers use is importable from here.

Completion-style workloads give ``prompt`` and ``completion`` as strings whose
concatenation is the training document. ShareGPT is chat-style: ``prompt`` is a tuple of
``{"role", "content"}`` messages (see ``Example``).
"""

from branchspec.data.workloads.example import Example
from branchspec.data.workloads.gsm8k import GSM8K_NUM_EVAL, gsm8k_prompt
from branchspec.data.workloads.json_stream import JsonArrayReader
from branchspec.data.workloads.mbpp import (
    MBPP_ENV_VAR,
    MBPP_HUB_FILES,
    MBPP_HUB_NAME,
    MBPP_HUB_TIMEOUT,
    MbppUnavailable,
    mbpp_prompt,
    mbpp_split,
    resolve_mbpp_path,
)
from branchspec.data.workloads.registry import (
    REGISTRY,
    WORKLOADS,
    Workload,
    get_workload,
    load_workload,
    training_text,
    workload_splits,
)
from branchspec.data.workloads.sharegpt import (
    SHAREGPT_EVAL_FRACTION,
    Conversation,
    ShareGPTParseStats,
    parse_sharegpt,
    sharegpt_base_id,
    sharegpt_conversation,
    sharegpt_parse_stats,
    sharegpt_split,
)

__all__ = [
    "GSM8K_NUM_EVAL",
    "MBPP_ENV_VAR",
    "MBPP_HUB_FILES",
    "MBPP_HUB_NAME",
    "MBPP_HUB_TIMEOUT",
    "REGISTRY",
    "SHAREGPT_EVAL_FRACTION",
    "WORKLOADS",
    "Conversation",
    "Example",
    "JsonArrayReader",
    "MbppUnavailable",
    "ShareGPTParseStats",
    "Workload",
    "get_workload",
    "gsm8k_prompt",
    "load_workload",
    "mbpp_prompt",
    "mbpp_split",
    "parse_sharegpt",
    "resolve_mbpp_path",
    "sharegpt_base_id",
    "sharegpt_conversation",
    "sharegpt_parse_stats",
    "sharegpt_split",
    "training_text",
    "workload_splits",
]

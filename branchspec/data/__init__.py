"""Workloads, tokenizer and chat template.

``workloads``: fixed train / eval splits of GSM8K, MBPP, ShareGPT and HumanEval, and the
training text built only from train splits. ``tokenizer``: a byte-level BPE tokenizer and
its wrapper. ``chat``: the one chat template and the special tokens.
"""

from branchspec.data.chat import CHAT_TEMPLATE, SPECIAL_TOKENS, render_chat
from branchspec.data.tokenizer import Tokenizer, train_tokenizer
from branchspec.data.workloads import (
    WORKLOADS,
    Example,
    load_workload,
    training_text,
    workload_splits,
)

__all__ = [
    "CHAT_TEMPLATE",
    "SPECIAL_TOKENS",
    "WORKLOADS",
    "Example",
    "Tokenizer",
    "load_workload",
    "render_chat",
    "train_tokenizer",
    "training_text",
    "workload_splits",
]

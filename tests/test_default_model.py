"""The embedded default checkpoint: loads offline, describes its training, and generates
deterministic greedy text that speculation reproduces exactly."""

import json
from pathlib import Path

from branchspec import LLM, SamplingParams, SpecConfig
from branchspec.llm import DEFAULT_CHECKPOINT

PROMPT = "Question: A farmer has 12 cows and buys 7 more. How many cows does he have now?\nAnswer:"


def test_default_checkpoint_is_complete():
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "training.json"):
        assert (DEFAULT_CHECKPOINT / name).is_file(), name
    info = json.loads((DEFAULT_CHECKPOINT / "training.json").read_text())
    assert info["steps"] > 0 and info["tokens_seen"] > 0 and info["held_out"]
    assert (DEFAULT_CHECKPOINT / "model.safetensors").stat().st_size < 50 * 2**20


def test_default_model_greedy_is_deterministic_and_lossless():
    llm = LLM()
    params = SamplingParams(max_tokens=24)
    a = llm.generate(PROMPT, params)[0]
    b = llm.generate(PROMPT, params)[0]
    c = llm.generate(PROMPT, params, spec=SpecConfig(3, 2, 6))[0]
    assert a.token_ids == b.token_ids == c.token_ids
    assert a.text.strip(), "the default model produced no text"
    assert c.accept_length > 1.0, "the trained drafter never agreed with the target"


def test_default_model_chat():
    llm = LLM()
    out = llm.chat([{"role": "user", "content": "Give me three tips for staying focused."}],
                   SamplingParams(max_tokens=16))[0]
    assert len(out.token_ids) >= 1 and isinstance(out.text, str)


def test_default_model_outputs_are_unchanged():
    """Greedy outputs recorded from the shipped checkpoint when it was shipped
    (`scripts/record_golden.py`): later changes to the model code must not move a token."""
    golden = json.loads((Path(__file__).parent / "data" / "default_golden.json").read_text())
    llm = LLM()
    params = SamplingParams(max_tokens=golden["max_tokens"], ignore_eos=True)
    assert [o.token_ids for o in llm.generate(golden["prompts"], params)] == golden["plain"]
    assert [o.token_ids for o in llm.generate(golden["prompts"], params, spec=SpecConfig(3, 2, 6))] == golden["tree"]
    assert llm.chat(golden["chat"], params)[0].token_ids == golden["chat_plain"]

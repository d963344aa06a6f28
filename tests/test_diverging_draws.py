"""scripts/diverging_draws.py recomputes a draw in float64 at the uniform the engine used
there: on a float64 model its token is the one the engine itself draws."""

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from branchspec import LLM, SamplingParams
from branchspec.checkpoint import save_checkpoint
from branchspec.config import tiny_config
from branchspec.model.init import random_model


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location(
        "diverging_draws", Path(__file__).parents[1] / "scripts" / "diverging_draws.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module          # its dataclass looks its module up there
    sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))     # its sibling study_cell.py
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.pop(0)
        del sys.modules[spec.name]
        sys.modules.pop("study_cell", None)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    folder = tmp_path_factory.mktemp("draws_ckpt")
    save_checkpoint(random_model(tiny_config(), seed=4, dtype="float64", std=0.3), folder)
    return LLM(folder, dtype="float64", max_batch_size=1, seed=0)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_the_float64_draw_is_the_engines_draw(script, llm, temperature):
    g = torch.Generator().manual_seed(9)
    agree, agree_off_by_one = 0, 0
    for seed in range(12):
        prompt = torch.randint(3, 64, (5 + seed,), generator=g).tolist()
        params = SamplingParams(temperature=temperature, max_tokens=4, ignore_eos=True, seed=seed)
        out = llm.generate([prompt], params)[0].token_ids
        prefix = prompt + out[:2]
        draw = script.float64_draw(llm, prefix, seed, temperature)      # the third token's draw
        assert draw.margin >= 0
        agree += draw.token == out[2]
        if temperature > 0:
            # Negative control: the uniform of the next position draws other tokens.
            u = script.seeded_uniforms([seed], np.array([[len(prefix) + 1]]))[0, 0]
            agree_off_by_one += int(script.inverse_cdf(draw.probs, torch.tensor(u))) == out[2]
    assert agree == 12
    if temperature > 0:
        assert agree_off_by_one < 12


def test_specs_parse(script):
    assert script.parse_spec("chain:5").is_chain
    tree = script.parse_spec("3x2:6:calibrated")
    assert (tree.num_steps, tree.topk, tree.num_draft_tokens, tree.selection) == (3, 2, 6, "calibrated")

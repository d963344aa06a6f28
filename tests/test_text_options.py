"""vLLM's text options: include_stop_str_in_output keeps the stop string (or a stop id's
text) at the end of the output; skip_special_tokens=False keeps special tokens' text.
Offline and over HTTP, streamed and not; the tokens are the same either way."""

from __future__ import annotations

import pytest

from branchspec.config import SamplingParams
from branchspec.serve.app import ServerState
from branchspec.serve.server import ThreadedServer
from test_server import CORPUS, KEY, PROMPTS, TREE, checkpoint_with_tokenizer, client, complete, new_llm

openai = pytest.importorskip("openai", reason="the [test] extra (openai) is not installed")

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return checkpoint_with_tokenizer(tmp_path_factory.mktemp("text_ckpt"), CORPUS)


@pytest.fixture(scope="module")
def offline(ckpt):
    return new_llm(ckpt)


@pytest.fixture(scope="module")
def server(ckpt):
    state = ServerState(new_llm(ckpt), TREE, model_name="tiny", api_key=KEY)
    with ThreadedServer(state) as s:
        yield s


def stop_inside(offline, prompt: str) -> str:
    """A stop string taken from the middle of the prompt's greedy output, so it cuts it."""
    text = offline.generate(prompt, SamplingParams(max_tokens=30, ignore_eos=True))[0].text
    assert len(text) > 12, text
    return text[8:11]


@pytest.mark.parametrize("spec", [None, TREE], ids=["plain", "tree"])
def test_include_stop_str_in_output_offline(offline, spec):
    for prompt in PROMPTS[:4]:
        stop = stop_inside(offline, prompt)
        cut, kept = (offline.generate(prompt, SamplingParams(max_tokens=30, ignore_eos=True, stop=stop,
                                                             include_stop_str_in_output=keep), spec=spec)[0]
                     for keep in (False, True))
        assert kept.text == cut.text + stop and kept.token_ids == cut.token_ids
        assert kept.finish_reason == cut.finish_reason == "stop" and kept.outputs[0].stop_reason == stop


def test_special_tokens_kept_only_when_asked(offline):
    pad = offline.config.pad_token_id
    name = offline.tokenizer.id_to_token(pad)
    params = dict(max_tokens=3, ignore_eos=True, logit_bias={pad: 100.0})
    plain = offline.generate(PROMPTS[0], SamplingParams(**params))[0]
    shown = offline.generate(PROMPTS[0], SamplingParams(**params, skip_special_tokens=False))[0]
    assert plain.token_ids == shown.token_ids == [pad] * 3
    assert plain.text == "" and shown.text == name * 3


def test_a_stop_ids_text_is_kept_with_include_stop_str_in_output(offline):
    pad = offline.config.pad_token_id
    params = dict(max_tokens=5, logit_bias={pad: 100.0}, stop_token_ids=[pad], skip_special_tokens=False)
    cut = offline.generate(PROMPTS[0], SamplingParams(**params))[0]
    kept = offline.generate(PROMPTS[0], SamplingParams(**params, include_stop_str_in_output=True))[0]
    assert cut.token_ids == kept.token_ids == [pad]
    assert cut.text == "" and kept.text == offline.tokenizer.id_to_token(pad)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_text_options_over_http_equal_offline(server, offline, stream):
    c = client(server)
    for prompt in PROMPTS[:3]:
        stop = stop_inside(offline, prompt)
        want = offline.generate(prompt, SamplingParams(max_tokens=30, ignore_eos=True, stop=stop,
                                                       include_stop_str_in_output=True), spec=TREE)[0]
        got = complete(c, prompt, max_tokens=30, stream=stream, stop=stop,
                       extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
        assert got[0] == want.text and got[1] == want.token_ids and want.text.endswith(stop)
    pad = offline.config.pad_token_id
    got = complete(c, PROMPTS[0], max_tokens=3, stream=stream, logit_bias={str(pad): 100},
                   extra_body={"ignore_eos": True, "skip_special_tokens": False})
    assert got[0] == offline.tokenizer.id_to_token(pad) * 3


def test_bad_text_options_are_400s_naming_them(server):
    c = client(server, max_retries=0)
    for name in ("include_stop_str_in_output", "skip_special_tokens"):
        with pytest.raises(openai.BadRequestError) as info:
            c.completions.create(model="tiny", prompt="hi", max_tokens=2, extra_body={name: "yes"})
        assert info.value.body["param"] == name

"""What clients written for a vLLM server expect of `branchspec serve`, over real HTTP.

vLLM's sampling extras (top_k, min_p, min_tokens, stop_token_ids, penalties, logit_bias)
give offline `LLM.generate`'s tokens; n > 1 and several prompts come back as choices
i * n + j with usage summed; echo with logprobs and max_tokens 0 scores a prompt in
OpenAI's legacy layout, equal to offline prompt_logprobs (what lm-eval's loglikelihood
reads); vLLM's prompt_logprobs; stop_reason; usage null on every chunk but the last;
/tokenize, /detokenize, /version, /v1/models/{id}, HEAD /health; transformers' rendering
of the shipped chat template equals the chat endpoint's prompt; /metrics carries vLLM's
speculative-decoding series, consistent with the rounds run; and each bad value gets a
400 naming its parameter. A tiny float64 model with a small trained tokenizer.
"""

from __future__ import annotations

import itertools
import json

import pytest

from branchspec.config import SamplingParams
from branchspec.serve.app import ServerState
from branchspec.serve.server import ThreadedServer
from test_server import (CORPUS, KEY, MAX_LEN, PROMPTS, TREE, checkpoint_with_tokenizer, client, extra, metrics,
                         new_llm, open_stream, pages_idle, raw)

openai = pytest.importorskip("openai", reason="the [test] extra (openai) is not installed")

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return checkpoint_with_tokenizer(tmp_path_factory.mktemp("clients_ckpt"), CORPUS)


@pytest.fixture(scope="module")
def offline(ckpt):
    return new_llm(ckpt)


@pytest.fixture(scope="module")
def server(ckpt):
    state = ServerState(new_llm(ckpt), TREE, model_name="tiny", api_key=KEY, max_queued_requests=24)
    with ThreadedServer(state) as s:
        yield s


def events(srv, path: str, body: dict) -> list[dict]:
    """Every data event of a stream, parsed (the final [DONE] checked and dropped)."""
    conn, resp = open_stream(srv, body) if path == "/v1/completions" else _open(srv, path, body)
    try:
        assert resp.status == 200, resp.read()
        lines = [ln.decode().strip() for ln in resp.read().splitlines()]
    finally:
        conn.close()
    data = [ln[len("data: "):] for ln in lines if ln.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def _open(srv, path, body):
    import http.client
    host, port = srv.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("POST", path, body=json.dumps({**body, "stream": True}),
                 headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    return conn, conn.getresponse()


# -- sampling extras ----------------------------------------------------------------------
EXTRAS = [
    dict(temperature=0.8, seed=11, top_k=5, min_p=0.05),
    dict(temperature=0, presence_penalty=1.2, frequency_penalty=0.5, repetition_penalty=1.5),
    dict(temperature=0, logit_bias={"7": 4.0, "12": -100}, min_tokens=6),
    dict(temperature=1.0, top_k=1, seed=3),
    dict(temperature=0.9, seed=5, top_p=0.8, repetition_penalty=0.7),
]


def offline_params(body: dict, max_tokens: int) -> SamplingParams:
    kw = {k: v for k, v in body.items() if k != "logit_bias"}
    bias = {int(k): v for k, v in body.get("logit_bias", {}).items()}
    return SamplingParams(max_tokens=max_tokens, logit_bias=bias, **kw)


def test_sampling_extras_over_http_equal_offline(server, offline):
    c = client(server)
    got = []
    for i, body in enumerate(EXTRAS):
        std = {k: body[k] for k in ("temperature", "seed", "top_p", "presence_penalty", "frequency_penalty",
                                   "logit_bias") if k in body}
        vllm = {k: v for k, v in body.items() if k not in std}
        r = c.completions.create(model="tiny", prompt=PROMPTS[i], max_tokens=24, extra_body=vllm, **std)
        got.append(extra(r.choices[0], "token_ids"))
    want = offline.generate(PROMPTS[:len(EXTRAS)], [offline_params(b, 24) for b in EXTRAS], spec=TREE)
    assert got == [w.token_ids for w in want]
    assert 12 not in got[2]


def test_stop_reason_and_stop_token_ids(server, offline):
    c = client(server)
    free = offline.generate([PROMPTS[0]], SamplingParams(max_tokens=30, ignore_eos=True), spec=TREE)[0]
    stop_id = free.token_ids[4]
    r = c.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=30, temperature=0,
                             extra_body={"stop_token_ids": [stop_id], "ignore_eos": True})
    ch = r.choices[0]
    cut = free.token_ids[:free.token_ids.index(stop_id) + 1]
    assert extra(ch, "token_ids") == cut and ch.finish_reason == "stop" and extra(ch, "stop_reason") == stop_id
    assert ch.text == offline.tokenizer.decode(cut[:-1])            # the stop id's text is not returned
    stop = free.text[len(free.text) // 2:len(free.text) // 2 + 2]
    ch = c.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=30, temperature=0, stop=[stop],
                              extra_body={"ignore_eos": True}).choices[0]
    assert (ch.finish_reason, extra(ch, "stop_reason")) == ("stop", stop) and stop not in ch.text
    ch = c.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=3, temperature=0,
                              extra_body={"ignore_eos": True}).choices[0]
    assert (ch.finish_reason, extra(ch, "stop_reason")) == ("length", None)


# -- n samples, several prompts --------------------------------------------------------------
def test_n_samples_and_several_prompts(server, offline):
    c = client(server)
    params = SamplingParams(temperature=1.0, max_tokens=10, seed=21, n=3, ignore_eos=True)
    want = offline.generate([PROMPTS[1], PROMPTS[3]], params, spec=TREE)
    r = c.completions.create(model="tiny", prompt=[PROMPTS[1], PROMPTS[3]], n=3, max_tokens=10, temperature=1.0,
                             seed=21, extra_body={"ignore_eos": True})
    assert [ch.index for ch in r.choices] == list(range(6))
    assert [extra(ch, "token_ids") for ch in r.choices] == [s.token_ids for w in want for s in w.outputs]
    assert [ch.text for ch in r.choices] == [s.text for w in want for s in w.outputs]
    n_prompt = len(want[0].prompt_token_ids) + len(want[1].prompt_token_ids)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (n_prompt, 60)   # each prompt once, samples summed
    # streamed: chunks of every choice interleave, each concatenating to the same text
    texts, ids, usage = {}, {}, None
    for ev in c.completions.create(model="tiny", prompt=[PROMPTS[1], PROMPTS[3]], n=3, max_tokens=10,
                                   temperature=1.0, seed=21, stream=True, stream_options={"include_usage": True},
                                   extra_body={"ignore_eos": True}):
        if ev.usage is not None:
            usage = ev.usage
        for ch in ev.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
            ids[ch.index] = ids.get(ch.index, []) + extra(ch, "token_ids")
    assert [texts[i] for i in range(6)] == [ch.text for ch in r.choices]
    assert [ids[i] for i in range(6)] == [extra(ch, "token_ids") for ch in r.choices]
    assert (usage.prompt_tokens, usage.completion_tokens) == (n_prompt, 60)
    # chat too; greedy samples are all the same
    r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=6,
                                  temperature=0)
    assert [ch.index for ch in r.choices] == [0, 1] and r.choices[0].message.content == r.choices[1].message.content
    pages_idle(server)


# -- echo and prompt logprobs --------------------------------------------------------------
def test_echo_scores_the_prompt_as_lm_eval_reads_it(server, offline):
    """echo + logprobs + max_tokens 0: the prompt back, with OpenAI's legacy logprobs of
    every prompt token (null first), equal to offline prompt_logprobs."""
    prompt = PROMPTS[2]
    want = offline.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=2))[0]
    ids = want.prompt_token_ids
    c = client(server)
    r = c.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=2, temperature=0)
    ch = r.choices[0]
    assert ch.text == prompt and extra(ch, "token_ids") == [] and r.usage.completion_tokens == 0
    lp = ch.logprobs
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, len(ids)):
        assert lp.token_logprobs[i] == pytest.approx(want.prompt_logprobs[i][ids[i]], abs=1e-12)
        assert 1 <= len(lp.top_logprobs[i]) <= 3          # keyed by text: parts of a character share one
        assert max(lp.top_logprobs[i].values()) == pytest.approx(max(want.prompt_logprobs[i].values()), abs=1e-12)
    # text_offset points into the echoed text: the BOS takes no room, the rest spell the prompt
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == 0
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] < len(prompt)
    # token ids scored the same way, echoed as their text
    r2 = c.completions.create(model="tiny", prompt=ids, max_tokens=0, echo=True, logprobs=2)
    assert r2.choices[0].logprobs.token_logprobs == lp.token_logprobs and r2.choices[0].text == prompt
    # with output: the prompt's entries, then the generated tokens'; streamed the same
    gen = offline.generate([prompt], SamplingParams(max_tokens=3, logprobs=1))[0]
    r3 = c.completions.create(model="tiny", prompt=prompt, max_tokens=3, echo=True, logprobs=1, temperature=0)
    assert r3.choices[0].text == prompt + gen.text and len(r3.choices[0].logprobs.tokens) == len(ids) + 3
    assert r3.choices[0].logprobs.token_logprobs[len(ids):] == pytest.approx([d[t] for d, t in
                                                                              zip(gen.logprobs, gen.token_ids)])
    evs = events(server, "/v1/completions", {"prompt": prompt, "max_tokens": 3, "echo": True, "logprobs": 1,
                                             "temperature": 0})
    assert "".join(e["choices"][0]["text"] for e in evs) == r3.choices[0].text
    streamed = [t for e in evs for t in e["choices"][0]["logprobs"]["token_logprobs"]]
    assert streamed == r3.choices[0].logprobs.token_logprobs


def _offsets_point_at_their_tokens(text: str, lp: dict, skip: set[int] = frozenset()) -> None:
    """Every text_offset is within the text, in order, and the text at it starts with its
    token's text (but for tokens the text does not spell, `skip`, and parts of a
    character, shown as U+FFFD)."""
    offsets = lp["text_offset"]
    assert offsets == sorted(offsets) and all(0 <= o <= len(text) for o in offsets)
    for i, (token, o) in enumerate(zip(lp["tokens"], offsets)):
        if i not in skip and "\ufffd" not in token and o < len(text):
            assert text.startswith(token, o), (i, token, o, text[o:o + 20])


@pytest.mark.parametrize("prompt", ["<|user|>hi there", "naïve café<|assistant|> — 你好<|end|>fox"])
def test_text_offset_points_at_each_token(server, offline, prompt):
    """Echoed special-token text takes its room in the echoed text (once its offsets ran
    short by the marker's length), a generated special token its room under
    skip_special_tokens false, none when skipped; a character split over tokens is one;
    streamed offsets equal the whole answer's."""
    tok = offline.tokenizer
    special = tok.token_to_id("<|user|>")
    for skip in (True, False):
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "echo": True, "logprobs": 1, "temperature": 0,
                "skip_special_tokens": skip, "logit_bias": {str(special): 100}, "ignore_eos": True}
        status, _, payload = raw(server, "POST", "/v1/completions", body)
        assert status == 200, payload
        choice = payload["choices"][0]
        lp = choice["logprobs"]
        assert choice["token_ids"] == [special] * 4
        assert choice["text"] == prompt + ("" if skip else "<|user|>" * 4)
        _offsets_point_at_their_tokens(choice["text"], lp, skip={0})          # 0: the BOS the server added
        n = len(lp["tokens"]) - 4
        assert lp["text_offset"][n:] == ([len(prompt)] * 4 if skip else [len(prompt) + 8 * j for j in range(4)])
        chunks = events(server, "/v1/completions", body)
        streamed = [o for e in chunks for o in e["choices"][0]["logprobs"]["text_offset"]]
        assert streamed == lp["text_offset"]
    # token-id prompts echo their text decoded, special tokens skipped: those take no room
    ids = offline.encode(prompt)
    status, _, payload = raw(server, "POST", "/v1/completions", {"model": "tiny", "prompt": ids, "max_tokens": 0,
                                                                 "echo": True, "logprobs": 0})
    choice = payload["choices"][0]
    specials = {i for i, t in enumerate(ids) if t in tok.special_token_ids}
    _offsets_point_at_their_tokens(choice["text"], choice["logprobs"], skip=specials)


def test_vllm_prompt_logprobs(server, offline):
    prompt = PROMPTS[0]
    want = offline.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=3))[0]
    ids = want.prompt_token_ids
    status, _, body = raw(server, "POST", "/v1/completions", {"prompt": prompt, "max_tokens": 1,
                                                               "prompt_logprobs": 3, "temperature": 0})
    assert status == 200
    got = body["choices"][0]["prompt_logprobs"]
    assert got[0] is None and len(got) == len(ids)
    for i in range(1, len(ids)):
        entry = got[i]
        assert {int(k) for k in entry} == set(want.prompt_logprobs[i])
        mine = entry[str(ids[i])]
        assert mine["logprob"] == pytest.approx(want.prompt_logprobs[i][ids[i]], abs=1e-12)
        better = sum(v > mine["logprob"] for v in want.prompt_logprobs[i].values())
        if better < 3:     # among the top 3: every better token is in the dict
            assert mine["rank"] == better + 1
            assert sorted(e["rank"] for e in entry.values()) == list(range(1, len(entry) + 1))
        else:              # outside them: its vocabulary rank is past 3, and theirs are 1-3
            assert mine["rank"] > 3
            assert sorted(e["rank"] for k, e in entry.items() if int(k) != ids[i]) == [1, 2, 3]
        assert all(e["decoded_token"] is not None for e in entry.values())
    chat = raw(server, "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                         "max_tokens": 2, "prompt_logprobs": 0})[2]
    assert chat["prompt_logprobs"][0] is None and all(len(e) == 1 for e in chat["prompt_logprobs"][1:])


# -- chat template, BOS ----------------------------------------------------------------------
def test_transformers_chat_template_equals_the_chat_endpoint(server, ckpt):
    """A client rendering the checkpoint's Jinja template with transformers and sending the
    ids to /v1/completions gets what /v1/chat/completions gives; text prompts and the
    tokenizer's own ids with BOS (add_special_tokens) agree too."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(ckpt))
    c = client(server)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."}]
    ids = list(hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"])
    r_chat = c.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
    r_ids = c.completions.create(model="tiny", prompt=ids, max_tokens=12, temperature=0)
    assert r_chat.usage.prompt_tokens == len(ids)
    assert extra(r_chat.choices[0], "token_ids") == extra(r_ids.choices[0], "token_ids")
    tok = raw(server, "POST", "/tokenize", {"messages": messages})[2]
    assert tok["tokens"] == ids
    text = PROMPTS[4]
    r_text = c.completions.create(model="tiny", prompt=text, max_tokens=8, temperature=0, logprobs=1)
    r_hf = c.completions.create(model="tiny", prompt=hf(text)["input_ids"], max_tokens=8, temperature=0, logprobs=1)
    assert extra(r_text.choices[0], "token_ids") == extra(r_hf.choices[0], "token_ids")
    assert r_text.choices[0].logprobs.token_logprobs == r_hf.choices[0].logprobs.token_logprobs
    no_bos = raw(server, "POST", "/tokenize", {"prompt": text, "add_special_tokens": False})[2]["tokens"]
    assert no_bos == hf(text, add_special_tokens=False)["input_ids"]


# -- small endpoints -----------------------------------------------------------------------
def test_small_endpoints(server, offline):
    c = client(server)
    status, _, body = raw(server, "POST", "/tokenize", {"prompt": PROMPTS[3], "return_token_strs": True})
    assert status == 200 and body["tokens"] == offline.encode(PROMPTS[3]) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == MAX_LEN and body["token_strs"][0] == "<|bos|>"
    status, _, back = raw(server, "POST", "/detokenize", {"tokens": body["tokens"]})
    assert status == 200 and back["prompt"] == PROMPTS[3]
    status, _, version = raw(server, "GET", "/version")
    assert status == 200 and version["version"]
    m = c.models.retrieve("tiny")
    assert m.id == "tiny" and m.object == "model"
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("gpt-4")
    status, headers, body = raw(server, "HEAD", "/health")
    assert status == 200 and body == ""
    # include_usage: usage null on every chunk but the last, which has no choices
    evs = events(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                                                  "stream_options": {"include_usage": True}})
    assert all("usage" in e and e["usage"] is None for e in evs[:-1])
    assert evs[-1]["choices"] == [] and evs[-1]["usage"]["completion_tokens"] == 4
    assert all("usage" not in e for e in events(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2}))
    # vLLM's continuous_usage_stats (guidellm asks for it): each chunk's usage so far
    evs = events(server, "/v1/completions", {"prompt": "hi", "max_tokens": 6, "ignore_eos": True,
                                             "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    counts = [e["usage"]["completion_tokens"] for e in evs[:-1]]
    assert counts == sorted(counts) and counts[-1] == 6 and evs[-1]["usage"]["completion_tokens"] == 6
    assert counts == list(itertools.accumulate(len(e["choices"][0]["token_ids"]) for e in evs[:-1]))


def test_metrics_carry_vllms_spec_decode_series(server):
    before = metrics(server)
    c = client(server)
    r = c.completions.create(model="tiny", prompt=PROMPTS[5], max_tokens=24, temperature=0,
                             extra_body={"ignore_eos": True})
    rounds = extra(r, "spec_stats")["num_rounds"]
    after = pages_idle(server)

    def delta(name, labels=()):
        return after.get((name, labels), 0) - before.get((name, labels), 0)

    assert delta("branchspec:spec_decode_num_drafts_total") == rounds > 0
    assert delta("branchspec:spec_decode_num_draft_tokens_total") == rounds * (TREE.num_draft_tokens - 1)
    accepted = delta("branchspec:spec_decode_num_accepted_tokens_total")
    per_pos = [delta("branchspec:spec_decode_num_accepted_tokens_per_pos_total", (("position", str(p)),))
               for p in range(TREE.num_draft_tokens - 1)]
    assert accepted == sum(per_pos) and per_pos == sorted(per_pos, reverse=True)
    # vLLM's mean acceptance length, 1 + accepted / drafts, is what spec_stats reports
    assert 1 + accepted / rounds == pytest.approx(extra(r, "spec_stats")["accept_length"], abs=1e-12)
    assert delta("branchspec:request_success_total", (("finished_reason", "length"),)) == 1
    assert delta("branchspec:request_generation_tokens_count") == 1
    assert delta("branchspec:request_generation_tokens_sum") == 24
    assert delta("branchspec:request_params_n_count") == 1
    names = {k[0] for k in after}
    for name in ("branchspec:kv_cache_usage_perc", "branchspec:num_preemptions_total",
                 "branchspec:request_prompt_tokens_count", "branchspec:request_params_max_tokens_count",
                 "branchspec:time_to_first_token_seconds_count", "branchspec:e2e_request_latency_seconds_count"):
        assert name in names, name


# -- errors ------------------------------------------------------------------------------------
def test_bad_values_get_400_naming_the_param(server):
    hi = {"prompt": "hi"}
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    cases = [
        ("/v1/completions", {**hi, "top_k": -2}, "top_k"),
        ("/v1/completions", {**hi, "top_k": 1.5}, "top_k"),
        ("/v1/completions", {**hi, "min_p": 2}, "min_p"),
        ("/v1/completions", {**hi, "min_tokens": 20, "max_tokens": 5}, "min_tokens"),
        ("/v1/completions", {**hi, "min_tokens": -1}, "min_tokens"),
        ("/v1/completions", {**hi, "stop_token_ids": [-1]}, "stop_token_ids[0]"),
        ("/v1/completions", {**hi, "stop_token_ids": [1, 99999]}, "stop_token_ids"),
        ("/v1/completions", {**hi, "stop_token_ids": 5}, "stop_token_ids"),
        ("/v1/completions", {**hi, "logit_bias": {"x": 1}}, "logit_bias"),
        ("/v1/completions", {**hi, "logit_bias": {"5": 200}}, "logit_bias.5"),
        ("/v1/completions", {**hi, "logit_bias": {"99999": 1}}, "logit_bias"),
        ("/v1/completions", {**hi, "logit_bias": [1]}, "logit_bias"),
        ("/v1/completions", {**hi, "frequency_penalty": 3}, "frequency_penalty"),
        ("/v1/completions", {**hi, "repetition_penalty": 0}, "repetition_penalty"),
        ("/v1/completions", {**hi, "n": 1000}, "n"),
        ("/v1/completions", {"prompt": ["a"] * 40}, "prompt"),
        ("/v1/completions", {**hi, "prompt_logprobs": 21}, "prompt_logprobs"),
        ("/v1/completions", {**hi, "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ("/v1/completions", {**hi, "echo": "yes"}, "echo"),
        ("/v1/completions", {**hi, "add_special_tokens": 1}, "add_special_tokens"),
        ("/v1/completions", {**hi, "best_of": 2}, "best_of"),
        ("/v1/completions", {**hi, "use_beam_search": True}, "use_beam_search"),
        ("/v1/completions", {**hi, "include_stop_str_in_output": 1}, "include_stop_str_in_output"),
        ("/v1/completions", {**hi, "guided_json": {}}, "guided_json"),
        ("/v1/completions", {**hi, "stream": True, "stream_options": {"continuous_usage_stats": True}},
         "stream_options.continuous_usage_stats"),     # needs include_usage, as in vLLM
        ("/v1/completions", {**hi, "stream": True, "stream_options": {"shout": True}}, "stream_options.shout"),
        ("/v1/completions", {"prompt": [], "max_tokens": 0}, "prompt"),
        ("/v1/chat/completions", {**chat, "max_completion_tokens": MAX_LEN}, "max_completion_tokens"),
        ("/v1/chat/completions", {**chat, "max_completion_tokens": 0}, "max_completion_tokens"),
        ("/v1/chat/completions", {**chat, "min_tokens": MAX_LEN}, "min_tokens"),
        ("/v1/chat/completions", {**chat, "add_generation_prompt": False}, "add_generation_prompt"),
        ("/v1/chat/completions", {**chat, "echo": True}, "echo"),
        ("/v1/chat/completions", {**chat, "chat_template": "{{ x }}"}, "chat_template"),
        ("/v1/chat/completions", {**chat, "top_k": 0.5}, "top_k"),
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ("/tokenize", {"prompt": "hi", "model": "gpt-4"}, "model"),
        ("/detokenize", {"tokens": [1.5]}, "tokens[0]"),
        ("/detokenize", {"tokens": [3, 99999]}, "tokens[1]"),
        ("/detokenize", {}, "tokens"),
    ]
    for path, body, param in cases:
        status, _, payload = raw(server, "POST", path, body)
        assert status in (400, 404) and payload["error"]["param"] == param, (body, payload)
        assert param.split(".")[0].split("[")[0] in payload["error"]["message"], payload
    pages_idle(server)

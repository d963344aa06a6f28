"""The chat template and the special tokens it is written in.

One template renders every chat-style text in the project: the training documents built
from ShareGPT (``workloads.training_text``), the prompts given to the model at
evaluation time (``Tokenizer.apply_chat_template``) and the copy stored with a
checkpoint (``tokenizer_config.json``, key ``chat_template``). Keeping it in one place is
what makes "the prompt the model sees at eval time is a prefix of the documents it was
trained on" true by construction.

The template is a Python ``str.format`` string with exactly two fields, ``{role}`` and
``{content}``, applied once per message and concatenated::

    <|system|>\\n{system text}<|end|>\\n       (optional, first message only)
    <|user|>\\n{user text}<|end|>\\n
    <|assistant|>\\n{assistant text}<|end|>\\n
    ...
    <|assistant|>\\n                          (the generation prompt)

The generation prompt is the part of the template before ``{content}``, rendered for the
assistant role, so a model that learnt the template opens its reply exactly where the
prompt leaves off, and stops by emitting ``<|end|>``. The template carries no ``<|bos|>``:
callers add it when encoding (``Tokenizer.encode(text, add_bos=True)``), so a rendered
chat never gets it twice.

Only ``str.format`` is used (no jinja2): the template is applied to the template, never to
the message text, so braces in message content are safe.

For other tools, ``tokenizer_config.json`` also carries the same template written in
Jinja (``jinja_chat_template``, key ``chat_template``, the one transformers'
``apply_chat_template`` renders, BOS included), while branchspec reads its own from
``branchspec_chat_template``. Both give the same token ids for ordinary messages. They
differ on content that spells a special token: branchspec spells ``<|assistant|>`` typed
in a message as text, while a Jinja renderer pastes the content into the prompt string,
whose special-token strings the tokenizer then turns into control ids, so a user can
open a turn (prompt injection). Serve untrusted chats through branchspec's renderer
(``/v1/chat/completions``, ``LLM.chat``), not as text rendered elsewhere.
"""

from __future__ import annotations

import json
import string
from collections.abc import Iterable, Mapping

BOS = "<|bos|>"
EOS = "<|eos|>"
PAD = "<|pad|>"
USER = "<|user|>"
ASSISTANT = "<|assistant|>"
SYSTEM = "<|system|>"
END = "<|end|>"

# Order fixes the token ids of a freshly trained tokenizer: <|bos|> = 0, <|eos|> = 1, ...
SPECIAL_TOKENS: tuple[str, ...] = (BOS, EOS, PAD, USER, ASSISTANT, SYSTEM, END)

ROLES: tuple[str, ...] = ("system", "user", "assistant")

CHAT_TEMPLATE = "<|{role}|>\n{content}<|end|>\n"

# Names the rendering rule stored next to the template in tokenizer_config.json, so a
# checkpoint carrying a jinja template (the usual HF meaning of `chat_template`) is
# rejected rather than rendered as literal text.
CHAT_TEMPLATE_FORMAT = "python-str.format"


def check_template(template: str) -> None:
    """Raise ValueError unless ``template`` has exactly the fields ``{role}`` and ``{content}``.

    Also checks that each message opens with its role's special token (``<|user|>``, ...),
    so role markers are always single token ids, never spelt out of ordinary text pieces.
    """
    fields = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    if sorted(fields) != ["content", "role"]:
        raise ValueError(
            f"chat template must use exactly the fields {{role}} and {{content}} once each, "
            f"got {fields!r} in {template!r}"
        )
    head = template.partition("{content}")[0]
    for role in ROLES:
        marker = f"<|{role}|>"
        if marker not in head.format(role=role):
            raise ValueError(
                f"chat template must open each message with its role marker ({marker} for "
                f"{role!r}) before {{content}}: {template!r}"
            )


def generation_prompt(template: str = CHAT_TEMPLATE) -> str:
    """The text that opens an assistant turn: the template up to ``{content}``."""
    check_template(template)
    return template.partition("{content}")[0].format(role="assistant")


def render_chat(
    messages: Iterable[Mapping[str, str]],
    *,
    add_generation_prompt: bool,
    template: str = CHAT_TEMPLATE,
) -> str:
    """Render ``messages`` (each ``{"role": ..., "content": ...}``) with ``template``.

    Roles must be one of ROLES, and "system" may only come first. With
    ``add_generation_prompt`` the text ends with an open assistant turn for the model to
    complete. Raises ValueError for an unknown role, a misplaced system message,
    non-string content, or a template that ``check_template`` rejects.
    """
    check_template(template)
    parts: list[str] = []
    for i, message in enumerate(messages):
        role = message.get("role")
        content = message.get("content")
        if role not in ROLES:
            raise ValueError(f"message {i}: role must be one of {ROLES}, got {role!r}")
        if role == "system" and i != 0:
            raise ValueError(f"message {i}: a system message may only come first")
        if not isinstance(content, str):
            raise ValueError(f"message {i}: content must be str, got {type(content).__name__}")
        parts.append(template.format(role=role, content=content))
    if add_generation_prompt:
        parts.append(generation_prompt(template))
    return "".join(parts)


def jinja_chat_template(template: str = CHAT_TEMPLATE) -> str:
    """``template`` written as a Jinja chat template, for transformers' ``apply_chat_template``
    (and lm-eval, vLLM, ...): it renders ``bos_token``, then every message as ``template``
    does, then the generation prompt when ``add_generation_prompt``; roles outside ROLES
    and a system message after the first raise, as ``render_chat`` does.

    Tokenized the way transformers tokenizes a rendered chat (special tokens parsed, none
    added), it gives ``Tokenizer.encode_chat``'s ids for messages that spell no special token.
    """
    check_template(template)

    def expression(text: str) -> str:
        """``text`` (a part of the template) as a Jinja expression of ``message``."""
        parts = []
        for literal, name, _, _ in string.Formatter().parse(text):
            if literal:
                parts.append(json.dumps(literal))   # JSON string escapes are Jinja's too
            if name is not None:
                parts.append(f"message[{json.dumps(name)}]")
        return " + ".join(parts) or '""'

    head = template.partition("{content}")[0]
    roles = json.dumps(list(ROLES))
    return ("{{- bos_token -}}"
            "{%- for message in messages -%}"
            f"{{%- if message['role'] not in {roles} -%}}"
            f"{{{{- raise_exception('role must be one of {', '.join(ROLES)}, got ' + message['role']) -}}}}"
            "{%- endif -%}"
            "{%- if message['role'] == 'system' and not loop.first -%}"
            "{{- raise_exception('a system message may only come first') -}}"
            "{%- endif -%}"
            f"{{{{- {expression(template)} -}}}}"
            "{%- endfor -%}"
            "{%- if add_generation_prompt -%}"
            f"{{{{- {json.dumps(head.format(role='assistant'))} -}}}}"
            "{%- endif -%}")

"""``Example``: one prompt of a workload with its reference completion."""

from __future__ import annotations

from dataclasses import dataclass

from branchspec.data.chat import CHAT_TEMPLATE, render_chat


@dataclass(frozen=True)
class Example:
    """One prompt with its reference completion.

    ``uid`` is unique within its workload (``(workload, uid)`` is the global key).
    ``prompt`` is a ``str`` for completion-style workloads, or a tuple of
    ``{"role", "content"}`` messages for chat (render it with
    ``Tokenizer.apply_chat_template``). Tuples rather than lists because loaders cache
    and share their examples; the message dicts themselves must not be mutated either.
    """

    workload: str
    uid: str
    prompt: str | tuple[dict[str, str], ...]
    completion: str

    @property
    def is_chat(self) -> bool:
        return not isinstance(self.prompt, str)

    def prompt_text(self, template: str = CHAT_TEMPLATE) -> str:
        """The prompt as the text the model is given (chat: rendered, generation prompt open)."""
        if isinstance(self.prompt, str):
            return self.prompt
        return render_chat(self.prompt, add_generation_prompt=True, template=template)

    def document(self, template: str = CHAT_TEMPLATE) -> str:
        """Prompt and completion as one text; ``prompt_text()`` is always a prefix of it."""
        if isinstance(self.prompt, str):
            return self.prompt + self.completion
        reply = {"role": "assistant", "content": self.completion}
        return render_chat((*self.prompt, reply), add_generation_prompt=False, template=template)

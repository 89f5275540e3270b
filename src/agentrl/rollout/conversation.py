"""A conversation kept as token ids, each turn an exact prefix extension of the previous prompt + output.

The first prompt of a branch is the chat template's rendering of the messages. After the model answers, the new
messages (tool results, error notes) are rendered with the whole conversation and only the text *after*
``rendered prompt + the model's raw output`` is tokenised: the next prompt is ``prompt + output_ids + delta_ids``.
So what the trainer sees is token for token what the engine was given and produced — no re-tokenisation of the
model's output ever. When the template breaks that extension (it rewrites an earlier part of the conversation),
a new branch starts from a fresh rendering; the trainer merges each branch into one sequence.

Images (a vision-language policy): a message's content may hold ``{"type": "image", "image": SHA256}`` parts
(the picture in :attr:`TokenConversation.pictures`); the chat template renders each as the placeholder
``<|vision_start|><|image_pad|><|vision_end|>``, and its ``<|image_pad|>`` is expanded to the image's token count
(:meth:`~agentrl.vision.processor.VisionProcessor.expand`) in the prompt and in every delta, so the ids are the ones
the engine computes. :attr:`TokenConversation.images` lists the current prompt's images in order (what each LLM call
sends and stores).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from agentrl.vision.images import LoadedImage
from agentrl.vision.processor import VisionProcessor, message_images, refuse_images


@dataclass(frozen=True)
class TurnDelta:
    """What was appended after a model output: the token delta, or the start of a new branch."""

    delta_ids: list[int]
    delta_text: str
    new_branch: bool


@dataclass
class TokenConversation:
    """Messages plus the token ids of the current prompt (``prompt_ids``) on branch ``branch``."""

    tokenizer: PreTrainedTokenizerBase
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    branch: int = 0
    prompt_ids: list[int] = field(default_factory=list)
    vision: VisionProcessor | None = None
    pictures: dict[str, LoadedImage] = field(default_factory=dict)
    """Every picture the messages refer to, by sha256."""
    images: list[str] = field(default_factory=list)
    """The current prompt's images (sha256) in order."""
    _text: str = ""

    def __post_init__(self) -> None:
        self.restart(self.messages)
        self.branch = 0

    def render(self, messages: list[dict[str, Any]]) -> str:
        kwargs: dict[str, Any] = {"tokenize": False, "add_generation_prompt": True}
        if self.tools:
            kwargs["tools"] = self.tools
        return self.tokenizer.apply_chat_template(messages, **kwargs)

    def encode(self, text: str, images: list[str] | None = None) -> list[int]:
        """``text``'s ids, the placeholders of ``images`` (in order) expanded to their token counts."""
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if not images:
            return ids
        if self.vision is None:
            refuse_images("the policy", len(images))
        return self.vision.expand(ids, [self.vision.image_tokens(self.pictures[sha]) for sha in images])

    def image_data(self) -> list[str]:
        """The current prompt's images as data: URIs, in order (a request's ``image_data``)."""
        return [self.pictures[sha].data_uri() for sha in self.images]

    def restart(self, messages: list[dict[str, Any]]) -> None:
        """Start a new branch from a fresh rendering of ``messages`` (e.g. after a context reset)."""
        self.messages = list(messages)
        self._text = self.render(self.messages)
        self.images = message_images(self.messages)
        self.prompt_ids = self.encode(self._text, self.images)
        self.branch += 1

    def append(self, output_ids: list[int], output_text: str, new_messages: list[dict[str, Any]]) -> TurnDelta:
        """Record the model's output (as the assistant message ``output_text``) and the ``new_messages`` after it.

        Returns the delta that extends ``prompt + output``; if the template does not extend it, a new branch is
        started and ``new_branch`` is true (``prompt_ids`` is then a complete fresh prompt).
        """
        produced = self._text + self.tokenizer.decode(output_ids, skip_special_tokens=False,
                                                      clean_up_tokenization_spaces=False)
        messages = [*self.messages, {"role": "assistant", "content": output_text}, *new_messages]
        rendered = self.render(messages)
        if rendered.startswith(produced):
            delta_text = rendered[len(produced):]
            new_images = message_images(new_messages)
            delta_ids = self.encode(delta_text, new_images)
            self.images = [*self.images, *new_images]
            self.messages = messages
            self.prompt_ids = [*self.prompt_ids, *output_ids, *delta_ids]
            self._text = rendered
            return TurnDelta(delta_ids=delta_ids, delta_text=delta_text, new_branch=False)
        self.restart(messages)
        return TurnDelta(delta_ids=list(self.prompt_ids), delta_text=self._text, new_branch=True)


"""A prompt row as the policy's input ids: the text as is, or the messages through the chat template.

    encode = build_prompt_encoder(cfg.data, tokenizer)
    ids = encode(row)      # DatasetError naming the row if it is over data.max_prompt_tokens

The length check runs when a row is encoded, that is when a trainer replica first reads it: a start-up
never tokenizes the dataset. A too-long row is an error (naming the row and the fix), not a skip: a
skipped row would change which prompts a run trains on without anyone having asked for it.

A row with images (a vision-language policy, `PromptEncoder(..., images=ImageProcessor)`): each
`<image>` of its text (or, when it has none, one per image before the text / the first user message)
becomes Qwen2-VL's `<|vision_start|><|image_pad|><|vision_end|>`, and each pad is then expanded to the
number of tokens its image gives, computed from the image's size in its header (nothing decoded).
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from jinja2 import TemplateError

from yatt_hpc.data.rows import DatasetError, PromptRow
from yatt_hpc.data.tokenizer import Tokenizer, TokenizerError
from yatt_hpc.vision.images import ImageError
from yatt_hpc.vision.processor import IMAGE_PLACEHOLDER, ImageProcessor, ImageTokenError, image_size, mark_images

if TYPE_CHECKING:
    from yatt_hpc.config.schema import DataConfig


class PromptEncoder:
    """Row -> prompt ids, checked against the token limit."""

    def __init__(self, tokenizer: Tokenizer, max_tokens: int, template: str | None = None,
                 images: ImageProcessor | None = None, tools: list[dict] | None = None) -> None:
        self.tokenizer, self.max_tokens, self.template, self.images = tokenizer, max_tokens, template, images
        self.tools = tools  # the agent's tool schemas, for the chat template's `tools=`

    def __call__(self, row: PromptRow) -> list[int]:
        if row.get("images"):
            row = self._mark_images(row)
        ids = self._tokens(row)
        if row.get("images"):
            try:
                ids = self.images.expand(ids, [image_size(b, row["origin"]) for b in row["images"]])
            except (ImageTokenError, ImageError) as err:
                raise DatasetError(f"{row['origin']}: {err}") from None
        if len(ids) > self.max_tokens:
            how = " after the chat template" if row["messages"] is not None else ""
            raise DatasetError(f"{row['origin']}: prompt is {len(ids)} tokens{how}, over data.max_prompt_tokens="
                               f"{self.max_tokens}; shorten the prompt or raise data.max_prompt_tokens")
        return ids

    def _mark_images(self, row: PromptRow) -> PromptRow:
        """The row with its image placeholders as the vision markers (see the module docstring)."""
        if self.images is None:
            raise DatasetError(f"{row['origin']}: the row has {len(row['images'])} image(s) but the policy "
                               "(model.path) is a text model; use a vision-language policy (Qwen2-VL), or "
                               "drop data.images_key")
        count = len(row["images"])
        if row["messages"] is None:
            return {**row, "prompt": mark_images(row["prompt"], count)}
        marked = any(IMAGE_PLACEHOLDER in m["content"] for m in row["messages"])
        first_user = next(k for k, m in enumerate(row["messages"]) if m["role"] == "user")
        messages = [{**m, "content": mark_images(m["content"], count if k == first_user and not marked else 0)}
                    for k, m in enumerate(row["messages"])]
        return {**row, "messages": messages}

    def _tokens(self, row: PromptRow) -> list[int]:
        if row["messages"] is None:
            ids = self.tokenizer.encode_prompt(row["prompt"])
        else:
            try:
                ids = self.tokenizer.encode_chat(row["messages"], self.template, tools=self.tools)
            except TemplateError as err:  # the template's own checks (raise_exception) and Jinja errors
                raise DatasetError(f"{row['origin']}: the chat template refused the row's messages "
                                   f"({type(err).__name__}: {err}); fix the messages (e.g. roles in the order the "
                                   "template wants) or give data.chat_template") from None
        return ids


def build_prompt_encoder(data: DataConfig, tokenizer: Tokenizer, images: ImageProcessor | None = None,
                         tools: list[dict] | None = None) -> PromptEncoder:
    """The encoder data.format asks for; a chat format without any template is refused here, not at step 1."""
    template = None
    if data.chat_template is not None:
        try:
            template = Path(data.chat_template).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise DatasetError(f"data.chat_template={data.chat_template!r} cannot be read ({err.__class__.__name__}: "
                               f"{err}); give the path of a Jinja chat template file (relative paths start in the "
                               f"working directory {Path.cwd()})") from None
    if data.format == "chat" and template is None and not tokenizer.has_chat_template:
        raise TokenizerError("data.format=chat needs a chat template, and the policy's tokenizer has none; "
                             "give data.chat_template (a Jinja template file) or use data.format=text")
    return PromptEncoder(tokenizer, data.max_prompt_tokens, template, images, tools)


"""What one prompt row is, and the checks that turn a raw record (a JSONL object, a Parquet row) into one.

    from yatt_hpc.data.rows import RowSchema
    schema = RowSchema(format="chat", system_prompt="Be brief.", require_answer=False)
    row = schema.row_from({"prompt": "2+2?", "answer": 4, "level": 1}, origin="p.jsonl:3", index=2)
    row["messages"]   # [{"role": "system", ...}, {"role": "user", "content": "2+2?"}]
    row["question"], row["answer"], row["metadata"]   # "2+2?", "4", {"level": 1}
    RowSchema(images_key="images").row_from({"prompt": "<image>How many?", "answer": 2, "images": ["a.png"]},
                                            origin="p.jsonl:1", index=0, base=Path("/data"))["images"]  # [b"\\x89PNG..."]

Every problem with a record is a `DatasetError` whose message starts with the record's origin (`path:line`
for JSONL, `path row N` for Parquet), names the column and says how to fix it, for the CLI to print as is.

Images (data.images_key): a row's column holds one image or a list of them, each encoded bytes, a file
path (relative to the dataset file's directory unless absolute) or a Hugging Face `Image()` struct
`{bytes, path}` (bytes win; null or `[]` is no image). They are read when the row is read,
checked from their header (yatt_hpc/vision/images.py: size limits, a damaged file) and kept encoded in
`row["images"]`: never decoded pixels, which the rank that consumes the row makes.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, TypedDict

from yatt_hpc.vision.images import ImageError, ImageLimits, check_image_bytes, read_image_file

ROLES = ("system", "user", "assistant", "tool")


class DatasetError(ValueError):
    """A user error in a prompt dataset; the message is complete and meant to be printed as is."""


class PromptRow(TypedDict):
    """One prompt.

    `id`: the row's own integer `id` column if it has one, else its 0-based index in the source.
    `prompt`: the row's prompt string (text format: the model's input), None for chat rows given as messages.
    `messages`: chat format: the conversation the chat template renders (data.system_prompt first); text: None.
    `question`: what the verifier/judge sees as the question: the prompt string or the last user message.
    `answer`: the reference the rule verifier checks; "" for a row without one (only when no term needs it).
    `metadata`: the row's other columns (JSON values), for reward functions.
    `images`: the row's images, encoded (PNG, JPEG... bytes, checked from their header), in the row's order; []
    for a text-only row or source (data.images_key unset).
    `image_names`: each image's file path as the row gave it, or `<origin> image k` for bytes given inline (what a
    sample table shows).
    `origin`: `path:line`, `path row N` or `demo:split#index`, for error messages."""

    id: int
    prompt: str | None
    messages: list[dict] | None
    question: str
    answer: str
    metadata: dict
    images: list[bytes]
    image_names: list[str]
    origin: str


class BasePromptSource(ABC):
    """A finite, indexable list of prompt rows."""

    name: str

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def row(self, index: int) -> PromptRow:
        """Row `index` in 0..len-1 of the source's own (unshuffled) order."""

    def probe(self) -> PromptRow:
        """The first row, read as cheaply as the source allows (no index of the whole source), so that
        a misnamed column fails when the source is opened rather than at the first step."""
        return self.row(0)


@dataclass(frozen=True)
class RowSchema:
    """Which columns a record's fields come from (data.prompt_key, ...) and what the run needs of them."""

    format: Literal["text", "chat"] = "text"
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    messages_key: str = "messages"
    system_prompt: str | None = None
    require_answer: bool = True
    metadata_columns: tuple[str, ...] | None = None
    images_key: str | None = None
    image_limits: ImageLimits = field(default_factory=ImageLimits)

    @property
    def consumed(self) -> tuple[str, ...]:
        """Columns the row's own fields hold; metadata is every other column (or the ones listed)."""
        return (self.prompt_key, self.answer_key) + ((self.messages_key,) if self.format == "chat" else ()) \
            + ((self.images_key,) if self.images_key is not None else ())

    def row_from(self, obj: dict, origin: str, index: int, base: Path | None = None) -> PromptRow:
        """The checked row of one record; `index` is its position in the source (its id without an `id`),
        `base` the directory relative image paths start from (the dataset file's)."""
        if self.format == "chat" and obj.get(self.messages_key) is not None:
            messages = self._messages(obj[self.messages_key], origin)
            prompt, question = None, next(m["content"] for m in reversed(messages) if m["role"] == "user")
        else:
            prompt = question = self._prompt(obj, origin)
            messages = [{"role": "user", "content": prompt}] if self.format == "chat" else None
        if messages is not None and self.system_prompt is not None and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        own_id = obj.get("id")
        return PromptRow(id=own_id if isinstance(own_id, int) and not isinstance(own_id, bool) else index,
                         prompt=prompt, messages=messages, question=question, answer=self._answer(obj, origin),
                         metadata=self._metadata(obj, origin), images=self._images(obj, origin, base),
                         image_names=self._image_names(obj, origin), origin=origin)

    def _prompt(self, obj: dict, origin: str) -> str:
        key = self.prompt_key
        if key not in obj:
            has = ", ".join(map(repr, obj)) or "none"
            if self.format == "text" and self.messages_key in obj:
                fix = f"this row holds chat messages in {self.messages_key!r}: set data.format=chat"
            elif self.format == "chat":
                fix = (f"give the row a {self.messages_key!r} list of {{role, content}} or a {key!r} string, "
                       "or set data.messages_key / data.prompt_key to the columns that hold them")
            else:
                fix = "add it, or set data.prompt_key to the column that holds the prompt"
            raise DatasetError(f"{origin}: row has no {key!r} column (it has: {has}); {fix}")
        prompt = obj[key]
        if not isinstance(prompt, str) or not prompt:
            raise DatasetError(f"{origin}: column {key!r} must be a non-empty string, got {_show(prompt)}; "
                               "fix the row or drop it")
        return prompt

    def _messages(self, value: object, origin: str) -> list[dict]:
        key = self.messages_key
        if not isinstance(value, list) or not value:
            what = "an empty list" if isinstance(value, list) else _show(value)
            raise DatasetError(f"{origin}: column {key!r} must be a non-empty list of {{\"role\", \"content\"}} "
                               f"messages, got {what}; fix the row or drop it")
        out = []
        for k, m in enumerate(value):
            where = f"{origin}: column {key!r} message {k}"
            if not isinstance(m, dict):
                raise DatasetError(f"{where} must be an object {{\"role\": ..., \"content\": ...}}, got {_show(m)}")
            if m.get("role") not in ROLES:
                raise DatasetError(f"{where} has role {_show(m.get('role'))}; a role is one of "
                                   f"{', '.join(ROLES)}")
            if not isinstance(m.get("content"), str):
                raise DatasetError(f"{where} ({m['role']}) must have a string 'content', got "
                                   f"{_show(m.get('content'))} (multimodal content lists are not supported)")
            out.append({f: v for f, v in m.items() if v is not None})  # Parquet structs fill absent fields with null
        if out[-1]["role"] == "assistant":
            raise DatasetError(f"{origin}: column {key!r} ends with an assistant message; a prompt ends with the "
                               "user's turn (the policy writes the reply): drop the last message (a reference "
                               f"reply belongs in the {self.answer_key!r} column)")
        if not any(m["role"] == "user" for m in out):
            raise DatasetError(f"{origin}: column {key!r} has no user message, so there is no question to answer; "
                               "add the user's turn")
        return out

    def _answer(self, obj: dict, origin: str) -> str:
        key = self.answer_key
        answer = obj.get(key)
        if answer is None and not self.require_answer:
            return ""
        if key not in obj:
            raise DatasetError(f"{origin}: row has no {key!r} column (it has: {', '.join(map(repr, obj)) or 'none'}); "
                               f"add the reference answer the rule verifier checks, set data.answer_key to the "
                               f"column that holds it, or score with the GenRM alone (reward.mode=rm_only)")
        if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
            raise DatasetError(f"{origin}: column {key!r} must be a string or a number, got {_show(answer)}; "
                               "fix the row, or score with the GenRM alone (reward.mode=rm_only, answers optional)")
        return str(answer)

    def _images(self, obj: dict, origin: str, base: Path | None) -> list[bytes]:
        key = self.images_key
        if key is None:
            return []
        if key not in obj:
            raise DatasetError(f"{origin}: row has no {key!r} column (it has: {', '.join(map(repr, obj)) or 'none'}); "
                               f"give every row its images (a text-only row: \"{key}\": []), set data.images_key to the "
                               "column that holds them, or unset data.images_key for a text-only dataset")
        value = obj[key]
        items = [] if value is None else value if isinstance(value, list) else [value]
        images = []
        for k, item in enumerate(items):
            where = f"{origin}: column {key!r} image {k}"
            try:
                images.append(self._image(item, where, base))
            except ImageError as err:
                raise DatasetError(str(err)) from None
        return images

    def _image_names(self, obj: dict, origin: str) -> list[str]:
        """Each image's path as the row gives it (called after `_images` checked the column)."""
        if self.images_key is None:
            return []
        value = obj[self.images_key]
        items = [] if value is None else value if isinstance(value, list) else [value]
        paths = [item.get("path") if isinstance(item, dict) else item for item in items]
        return [p if isinstance(p, str) and p else f"{origin} image {k}" for k, p in enumerate(paths)]

    def _image(self, item: object, where: str, base: Path | None) -> bytes:
        """One image's encoded bytes: given, or read from its file."""
        value = item
        if isinstance(item, dict) and set(item) <= {"bytes", "path"}:  # Hugging Face's Image(): bytes win
            value = item.get("bytes") if item.get("bytes") is not None else item.get("path")
        if isinstance(value, (bytes, bytearray)):
            data = bytes(value)
        elif isinstance(value, str) and value:
            path = Path(value) if base is None else base / value  # an absolute path stays itself
            where = f"{where} ({value})"
            data = read_image_file(path, where, self.image_limits)
        else:
            raise DatasetError(f"{where} must be encoded image bytes, a file path or a {{\"bytes\", \"path\"}} "
                               f"struct with one of them set, got {_show(item)}; fix the row (a row without images "
                               "gives an empty list)")
        check_image_bytes(data, where, self.image_limits)
        return data

    def _metadata(self, obj: dict, origin: str) -> dict:
        if self.metadata_columns is None:
            return {k: v for k, v in obj.items() if k not in self.consumed}
        missing = [c for c in self.metadata_columns if c not in obj]
        if missing:
            raise DatasetError(f"{origin}: data.metadata_columns names {', '.join(map(repr, missing))} but the row has "
                               f"no such column (it has: {', '.join(map(repr, obj))}); add it or drop it from "
                               "data.metadata_columns")
        return {c: obj[c] for c in self.metadata_columns}


def _show(value: object) -> str:
    if value is None:
        return "null"
    text = repr(value)
    return f"{type(value).__name__} {text[:60] + '...' if len(text) > 60 else text}"

"""Text in and out of the engine: a checkpoint's ``tokenizer.json`` read by the ``tokenizers`` package (a core
dependency), transformers' ``AutoTokenizer`` only where it is needed and installed (a checkpoint without
tokenizer.json, or a chat template), and incremental detokenisation for streaming and stop strings.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from typing import Any

TOKENIZER_FILE = "tokenizer.json"
# Tokenizer files that only transformers reads (a sentencepiece model, or a config naming a Python class).
_TRANSFORMERS_FILES = ("tokenizer.model", "tokenizer_config.json")
# Prompt tokens that seed a stream's detokeniser: decoders that drop a leading space at the start of a
# text (sentencepiece's) keep the first generated word's space when it follows context.
_STREAM_CONTEXT = 4


class Tokenizer:
    """A checkpoint's tokenizer: ``encode`` text -> ids (with the special tokens its post-processor adds,
    such as BOS), ``decode`` ids -> text.

    backend: a ``tokenizers.Tokenizer`` or a transformers tokenizer; source: the file or directory it was
    read from (None for an object passed in). ``apply_chat_template`` loads transformers' AutoTokenizer
    from ``source`` when the backend is not a transformers tokenizer already."""

    def __init__(self, backend: Any, source: str | None):
        self.backend = backend
        self.source = source
        # The tokenizers package's Tokenizer (encode returns an Encoding) rather than a transformers one.
        self._fast = hasattr(backend, "get_vocab_size")
        self._chat: Any = None if self._fast else backend

    def encode(self, text: str) -> list[int]:
        return list(self.backend.encode(text).ids if self._fast else self.backend.encode(text))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of ``messages`` ([{"role": ..., "content": ...}]) rendered by the checkpoint's chat
        template with the assistant's turn opened. Needs transformers (ValueError naming ``chat`` if it is
        missing or the checkpoint has no template)."""
        if self._chat is None:
            if self.source is None:
                raise ValueError("chat: a tokenizers.Tokenizer object carries no chat template; pass the "
                                 "checkpoint's tokenizer path instead")
            directory = os.path.dirname(self.source) if os.path.isfile(self.source) else self.source
            self._chat = _auto_tokenizer(directory, "chat", "chat templates")
        if not getattr(self._chat, "chat_template", None):
            raise ValueError(f"chat: the tokenizer at {self.source} has no chat template")
        ids = self._chat.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        # transformers >= 5 returns a BatchEncoding for tokenize=True, earlier versions a list.
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _auto_tokenizer(directory: str, name: str, need: str) -> Any:
    """transformers' AutoTokenizer for ``directory``; ValueError naming ``name`` ("``need`` need transformers")
    where transformers is missing or cannot read it."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ValueError(f"{name}: {need} need transformers (pip install transformers)") from None
    try:
        return AutoTokenizer.from_pretrained(directory)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{name}: transformers could not read the tokenizer in {directory}: {exc}") from None


def has_tokenizer_files(directory: str | os.PathLike) -> bool:
    """Whether a checkpoint directory ships tokenizer files of any kind."""
    return any(os.path.isfile(os.path.join(directory, f)) for f in (TOKENIZER_FILE, *_TRANSFORMERS_FILES))


def load_tokenizer(path: str | os.PathLike, name: str = "tokenizer") -> Tokenizer:
    """A tokenizer from ``path``: a tokenizer.json file, or a directory holding one (read with the
    ``tokenizers`` package) or only transformers' files (tokenizer.model / tokenizer_config.json, read with
    AutoTokenizer when transformers is installed). ValueError naming ``name`` and the path otherwise."""
    path = os.fspath(path)
    if os.path.isdir(path):
        file = os.path.join(path, TOKENIZER_FILE)
        if not os.path.isfile(file):
            if not has_tokenizer_files(path):
                raise ValueError(f"{name}: {path} has no tokenizer files ({TOKENIZER_FILE})")
            return Tokenizer(_auto_tokenizer(path, name, f"tokenizer files other than {TOKENIZER_FILE} (in {path})"),
                             path)
    elif os.path.isfile(path):
        file = path
    else:
        raise ValueError(f"{name}: {path} is neither a {TOKENIZER_FILE} file nor a directory holding one")
    from tokenizers import Tokenizer as FastTokenizer

    try:
        backend = FastTokenizer.from_file(file)
    except Exception as exc:  # the tokenizers package raises a bare Exception for unreadable files
        raise ValueError(f"{name}: {file} is not a readable {TOKENIZER_FILE} ({exc})") from None
    return Tokenizer(backend, file)


def missing_tokenizer_hint(model: Any) -> str:
    """Why "auto" found no tokenizer for ``model``, when the reason is a missing package ("" otherwise)."""
    if isinstance(model, (str, os.PathLike)) and os.path.isdir(model) and has_tokenizer_files(model) \
            and not os.path.isfile(os.path.join(model, TOKENIZER_FILE)):
        return (f"; {os.fspath(model)} has no {TOKENIZER_FILE}, and its other tokenizer files need transformers "
                "(pip install transformers)")
    return ""


def resolve_tokenizer(tokenizer: Any, model: Any) -> Any:
    """What ``LLM(tokenizer=...)`` holds: "auto" reads the checkpoint directory's tokenizer when it ships one
    that can be read here (None otherwise: no files, files that only transformers reads without
    transformers installed, the built-in or an already loaded model); a path (str / PathLike) is read with
    ``load_tokenizer``; None means no tokenizer; any other object (a ``tokenizers.Tokenizer`` or a
    transformers tokenizer) must have ``encode(text)`` and ``decode(ids, skip_special_tokens=...)`` methods
    and is wrapped in a Tokenizer. TypeError / ValueError naming ``tokenizer`` otherwise."""
    if tokenizer is None:
        return None
    if isinstance(tokenizer, str) and tokenizer == "auto":
        if not isinstance(model, (str, os.PathLike)) or not os.path.isdir(model):
            return None
        if os.path.isfile(os.path.join(model, TOKENIZER_FILE)) or \
                (has_tokenizer_files(model) and importlib.util.find_spec("transformers") is not None):
            return load_tokenizer(model)
        return None
    if isinstance(tokenizer, (str, os.PathLike)):
        return load_tokenizer(tokenizer)
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    if not (callable(getattr(tokenizer, "encode", None)) and callable(getattr(tokenizer, "decode", None))):
        raise TypeError(f"tokenizer: expected 'auto', None, a path or an object with encode/decode methods, "
                        f"got {type(tokenizer).__name__}")
    return Tokenizer(tokenizer, None)


class Detokenizer:
    """The text of a growing list of generated ids, one step's worth at a time.

    Decoding token by token breaks words that span tokens (byte-level pieces of one character, or a
    decoder that drops a leading space), so each ``push`` decodes a short window: the ids since the last
    emitted text, after a few tokens of context, and emits only text that is complete (not ending in an
    unfinished UTF-8 sequence). ``text`` is everything emitted so far."""

    def __init__(self, tokenizer: Any, context: Sequence[int] = ()):
        self.tokenizer = tokenizer
        self.ids = list(context[-_STREAM_CONTEXT:])
        self._prefix = 0  # start of the decoded window
        self._read = len(self.ids)  # ids up to here are in ``text``
        self.text = ""

    def push(self, token_id: int) -> str:
        """Add one generated id; returns the text it completes (possibly "")."""
        self.ids.append(token_id)
        before = self.tokenizer.decode(self.ids[self._prefix:self._read], skip_special_tokens=True)
        after = self.tokenizer.decode(self.ids[self._prefix:], skip_special_tokens=True)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        delta = after[len(before):]
        self._prefix, self._read = self._read, len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """The text of ids that ``push`` held back (an unfinished character at the end), for a finished
        sequence: its decoded form as it stands. Not added to ``text``."""
        before = self.tokenizer.decode(self.ids[self._prefix:self._read], skip_special_tokens=True)
        after = self.tokenizer.decode(self.ids[self._prefix:], skip_special_tokens=True)
        return after[len(before):]


def find_stop(text: str, stops: Sequence[str], start: int = 0) -> tuple[int, str] | None:
    """The earliest stop string in ``text`` that ends after ``start`` (text before it was searched already):
    (its index, the string), or None."""
    best = None
    for stop in stops:
        at = text.find(stop, max(0, start - len(stop) + 1))
        if at >= 0 and (best is None or at < best[0]):
            best = (at, stop)
    return best

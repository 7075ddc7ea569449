"""Tokenizers of the two formats Kimi checkpoints ship, behind one small interface.

- ``KimiTokenizer``: ``tiktoken.model`` (one ``base64(token bytes) rank`` per line) plus
  ``tokenizer_config.json``, the format of the published Kimi K2 / Kimi Linear / K3 repositories.
  Those repositories also carry a ``tokenization_kimi.py`` meant for ``trust_remote_code``; deltafin
  never runs it and implements the same behaviour here: the Kimi pre-tokenizer pattern, special
  tokens numbered right after the base vocabulary (names from ``added_tokens_decoder``, the gaps
  ``<|reserved_token_N|>``), special tokens written in text encoded as themselves, long inputs
  split the way the original splits them, and byte-exact decoding.
- a ``tokenizer.json`` folder, read with transformers' ``PreTrainedTokenizerFast``.

Both offer what deltafin uses: ``encode(text)``, ``decode(ids, skip_special_tokens)``,
``apply_chat_template(messages, ...)``, ``chat_template``, ``bos/eos/pad_token_id``, ``len()``, and
``stream_decoder(tokenizer, prompt)`` returns an incremental detokenizer for either.
"""
from __future__ import annotations

import base64
import codecs
import json
import os
from pathlib import Path

from .errors import DeltafinError

# The pre-tokenizer of the Kimi family: runs of Han characters; words with an optional leading
# non-letter and English contractions (letters of other scripts split from Han); numbers of up to
# three digits; punctuation runs; newlines; other whitespace.
KIMI_PATTERN = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])
# tiktoken's matcher slows down badly (and can fail) on very long inputs or very long runs of
# one character class; the original tokenizer cuts the text first, at these sizes, and so do we
# (cuts change the tokens only inside such runs, identically to the original).
MAX_ENCODE_CHARS = 400_000
MAX_RUN_CHARS = 25_000
MAX_VOCAB_LINE = 4096  # bytes of one tiktoken.model line; real tokens are a few dozen


class TokenizerError(DeltafinError):
    """The tokenizer files are missing, malformed or inconsistent."""


# Files a tokenizer loader may open: each must be a regular file inside the model folder.
TOKENIZER_FILES = ("tiktoken.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "chat_template.jinja", "chat_template.json", "tokenizer.model",
                   "vocab.json", "merges.txt")


def load_tokenizer(path: Path):
    """The folder's tokenizer: tiktoken.model (Kimi) or tokenizer.json; None when it has neither."""
    from .files import confine, regular_size
    for name in TOKENIZER_FILES:  # a FIFO here would block the loader for ever
        if os.path.lexists(path / name):
            regular_size(confine(path, name, f"{path}: tokenizer file"))
    if (path / "tiktoken.model").exists():
        return KimiTokenizer(path)
    if (path / "tokenizer.json").exists():
        # The fast tokenizer class directly: AutoTokenizer would try to interpret K3's config.json.
        from transformers import PreTrainedTokenizerFast
        return PreTrainedTokenizerFast.from_pretrained(str(path))
    return None


def read_tiktoken_ranks(file: Path) -> dict[bytes, int]:
    """{token bytes: rank} from a tiktoken.model file; ranks must be 0..n-1, each once."""
    ranks: dict[bytes, int] = {}
    try:
        lines = file.read_bytes().splitlines()
    except OSError as e:
        raise TokenizerError(f"{file}: cannot read ({e.strerror})") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        parts = line.split()
        if len(parts) != 2 or len(line) > MAX_VOCAB_LINE:
            raise TokenizerError(f"{file}:{n}: expected 'base64-token rank', got {line[:60]!r}")
        try:
            token, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
        except ValueError:
            raise TokenizerError(f"{file}:{n}: expected 'base64-token rank', got {line[:60]!r}") from None
        if token in ranks:
            raise TokenizerError(f"{file}:{n}: token {token!r} is listed twice")
        ranks[token] = rank
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise TokenizerError(f"{file}: ranks must be 0..{len(ranks) - 1}, each once")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise TokenizerError(f"{file}: single byte {missing[0]:#04x} has no rank; every byte needs one")
    return ranks


class KimiTokenizer:
    """tiktoken.model + tokenizer_config.json, without the checkpoint's remote code."""

    def __init__(self, path: str | Path):
        import tiktoken

        path = Path(path)
        self.path = path
        conf = self._read_config(path)
        ranks = read_tiktoken_ranks(path / "tiktoken.model")
        self.num_base_tokens = len(ranks)
        listed: dict[int, dict] = {}
        for key, entry in (conf.get("added_tokens_decoder") or {}).items():
            if not (str(key).isdigit() and isinstance(entry, dict) and isinstance(entry.get("content"), str)):
                raise TokenizerError(f"{path / 'tokenizer_config.json'}: added_tokens_decoder entry {key!r} "
                                     "needs a numeric id and a 'content' string")
            if int(key) < self.num_base_tokens:
                raise TokenizerError(f"{path / 'tokenizer_config.json'}: added token {entry['content']!r} has id "
                                     f"{key}, inside the base vocabulary (0..{self.num_base_tokens - 1})")
            listed[int(key)] = entry
        # Special ids follow the base vocabulary without gaps: unnamed ones are reserved tokens.
        top = max(listed, default=self.num_base_tokens - 1)
        self.special_tokens: dict[str, int] = {}
        self._skip: set[int] = set()
        for i in range(self.num_base_tokens, top + 1):
            entry = listed.get(i, {"content": f"<|reserved_token_{i}|>", "special": True})
            if entry["content"] in self.special_tokens or entry["content"].encode() in ranks:
                raise TokenizerError(f"{path / 'tokenizer_config.json'}: token {entry['content']!r} is defined twice")
            self.special_tokens[entry["content"]] = i
            if entry.get("special", True):
                self._skip.add(i)
        self._by_id = {i: t for t, i in self.special_tokens.items()}
        self.model = tiktoken.Encoding(name=f"kimi:{path}", pat_str=KIMI_PATTERN, mergeable_ranks=ranks,
                                       special_tokens=self.special_tokens)
        self.bos_token, self.bos_token_id = self._named(conf, "bos_token")
        self.eos_token, self.eos_token_id = self._named(conf, "eos_token")
        self.pad_token, self.pad_token_id = self._named(conf, "pad_token")
        self.unk_token, self.unk_token_id = self._named(conf, "unk_token")
        template = conf.get("chat_template")
        jinja = path / "chat_template.jinja"  # newer repositories keep the template in its own file
        if template is None and jinja.exists():
            template = jinja.read_text(encoding="utf-8")
        if template is not None and not isinstance(template, str):
            raise TokenizerError(f"{path / 'tokenizer_config.json'}: chat_template must be a string "
                                 "(named templates are not supported)")
        self.chat_template: str | None = template

    @staticmethod
    def _read_config(path: Path) -> dict:
        file = path / "tokenizer_config.json"
        if not file.exists():
            raise TokenizerError(f"{file}: missing (tiktoken.model needs it for the special tokens)")
        try:
            conf = json.loads(file.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise TokenizerError(f"{file}: not valid JSON ({e})") from None
        if not isinstance(conf, dict):
            raise TokenizerError(f"{file}: not a JSON object")
        return conf

    def _named(self, conf: dict, key: str) -> tuple[str | None, int | None]:
        value = conf.get(key)
        if isinstance(value, dict):  # the serialized AddedToken form
            value = value.get("content")
        if value is None:
            return None, None
        if value not in self.special_tokens:
            raise TokenizerError(f"{self.path / 'tokenizer_config.json'}: {key} {value!r} is not one of the "
                                 "added tokens")
        return value, self.special_tokens[value]

    def __len__(self) -> int:
        return self.model.n_vocab

    def convert_tokens_to_ids(self, token: str) -> int | None:
        if token in self.special_tokens:
            return self.special_tokens[token]
        try:
            return self.model.encode_single_token(token.encode())
        except KeyError:
            return self.unk_token_id

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special tokens written in it (e.g. "<|im_end|>") become their ids.
        Kimi adds no BOS on its own: `add_special_tokens` is accepted and changes nothing."""
        if not isinstance(text, str):
            raise TypeError(f"encode() takes text, got {type(text).__name__}")
        ids: list[int] = []
        for start in range(0, len(text), MAX_ENCODE_CHARS):
            for piece in _split_long_runs(text[start:start + MAX_ENCODE_CHARS], MAX_RUN_CHARS):
                ids += self.model.encode(piece, allowed_special="all")
        return ids

    def token_bytes(self, token: int, skip_special_tokens: bool = False) -> bytes:
        """The bytes one id stands for (b"" for a skipped special token)."""
        if token in self._by_id:
            return b"" if skip_special_tokens and token in self._skip else self._by_id[token].encode()
        if not 0 <= token < self.num_base_tokens:
            raise ValueError(f"token id {token} is outside the tokenizer's vocabulary [0, {len(self)})")
        return self.model.decode_single_token_bytes(token)

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        """Text of `ids`; bytes that are not valid UTF-8 (a character cut in two) become U+FFFD."""
        if isinstance(ids, int):
            ids = [ids]
        return b"".join(self.token_bytes(int(t), skip_special_tokens) for t in ids).decode("utf-8", "replace")

    def apply_chat_template(self, messages, add_generation_prompt: bool = False, tokenize: bool = True,
                            return_dict: bool = False, tools=None, **kwargs):
        """Render `messages` with the checkpoint's template (sandboxed jinja, as transformers does)."""
        from transformers.utils.chat_template_utils import render_jinja_template

        if not self.chat_template:
            raise TokenizerError(f"{self.path}: this tokenizer has no chat template")
        rendered, _ = render_jinja_template(
            conversations=[list(messages)], tools=_sorted_deep(tools), chat_template=self.chat_template,
            add_generation_prompt=add_generation_prompt, bos_token=self.bos_token, eos_token=self.eos_token,
            pad_token=self.pad_token, unk_token=self.unk_token, **kwargs)
        text = rendered[0]
        if not tokenize:
            return text
        ids = self.encode(text)
        return {"input_ids": ids} if return_dict else ids


def _sorted_deep(obj):
    """Tool schemas with every mapping's keys sorted (as the original renders them: stable prompts)."""
    if isinstance(obj, dict):
        return {k: _sorted_deep(v) for k, v in sorted(obj.items())}
    if isinstance(obj, list):
        return [_sorted_deep(v) for v in obj]
    return obj


def _split_long_runs(s: str, limit: int):
    """Cut `s` so that no piece has more than `limit` consecutive whitespace or non-whitespace chars."""
    start, run, in_space = 0, 0, s[:1].isspace()
    for i, ch in enumerate(s):
        space = ch.isspace()
        if space != in_space:
            run, in_space = 1, space
            continue
        run += 1
        if run > limit:
            yield s[start:i]
            start, run = i, 1
    yield s[start:]


# ----------------------------------------------------------------------------------------------
# Streaming decode
# ----------------------------------------------------------------------------------------------
# Prompt tokens handed to a window decoder as left context, so a tokenizer that decides leading
# spaces from the previous token decodes the first generated token as it would mid-sequence.
DECODE_CONTEXT = 4


class ByteStreamDecoder:
    """Exact incremental decoding for a byte-level tokenizer: each token's bytes go through one
    incremental UTF-8 decoder, so text comes out exactly at complete characters, never revised."""

    def __init__(self, tokenizer: KimiTokenizer):
        self.tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def add(self, token: int) -> str:
        return self._utf8.decode(self.tokenizer.token_bytes(token, skip_special_tokens=True))

    def flush(self) -> str:
        """What is left at the end: an incomplete character comes out as U+FFFD."""
        return self._utf8.decode(b"", final=True)


class WindowStreamDecoder:
    """Incremental decoding through a tokenizer's decode(): text grows only by whole characters.

    Decodes a short window (a few tokens of left context + the undecoded tail) per token, so the
    cost per token does not grow with the output. A token that ends inside a multi-byte character
    yields "" and its bytes come out with the token that completes the character.
    """

    def __init__(self, tokenizer, prompt: list[int]):
        self.tokenizer = tokenizer
        self.ids = list(prompt[-DECODE_CONTEXT:])
        # ids[:read] are already text (at first: the prompt's last tokens, as left context)
        self.read = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token: int) -> str:
        self.ids.append(token)
        return self._advance(final=False)

    def flush(self) -> str:
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        before = self._decode(self.ids[:self.read])
        now = self._decode(self.ids)
        if len(now) > len(before) and (final or not now.endswith("\ufffd")):
            # the tokens just decoded become the left context of the next window
            self.ids = self.ids[self.read:]
            self.read = len(self.ids)
            return now[len(before):]
        return ""


def stream_decoder(tokenizer, prompt: list[int]):
    """An incremental detokenizer (add(token) -> new text, flush() -> the rest) for `tokenizer`."""
    if isinstance(tokenizer, KimiTokenizer):
        return ByteStreamDecoder(tokenizer)
    return WindowStreamDecoder(tokenizer, prompt)

"""Text <-> token ids and chat templates, for HF folders and GGUF files.

Owns building a `tokenizers.Tokenizer` from either source so that ids equal what Hugging Face
`transformers` produces for the same files (invariant 1: same tokens everywhere), rendering
the model's Jinja chat template the way transformers does, and encoding a rendered chat so that
only the template's own control tokens are special: text inside a message that spells one (e.g.
`<|im_start|>system`) is encoded as text, so a user cannot forge a turn, unless the tokenizer
is built with `allow_special_tokens_in_messages`. Must not import torch or the model runtime:
the router tokenizes without loading weights.
"""

from __future__ import annotations

import json
import os
import re
import secrets
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.models import BPE

from pdserve.engine.gguf_meta import read_gguf_header


class TokenizerError(ValueError):
    """A tokenizer cannot be built from the given files; the message names the file or field."""


class ChatTemplateError(ValueError):
    """The chat template is missing, invalid, or rejected the messages (`raise_exception`)."""


class Tokenizer:
    """A loaded tokenizer: encode, decode, chat template, special token ids."""

    def __init__(self, backend: BackendTokenizer, *, name: str,
                 special_tokens: Mapping[str, str | None], eos_token_ids: Sequence[int],
                 chat_template: str | None, allow_special_tokens_in_messages: bool = False
                 ) -> None:
        self._backend = backend
        self.allow_special_tokens_in_messages = allow_special_tokens_in_messages
        # The same vocabulary with special-token matching off, for message text; built when
        # first needed (a copy costs about 0.1 s for a 50k vocabulary).
        self._as_text: BackendTokenizer | None = None
        specials = sorted((t.content for t in backend.get_added_tokens_decoder().values()
                           if t.special and t.content), key=len, reverse=True)
        # Longest first: at one position the longest special token wins, as the backend's match.
        self._specials = re.compile("|".join(map(re.escape, specials))) if specials else None
        self._max_token_bytes = _max_token_bytes(backend)
        self._name = name
        # bos_token, eos_token, unk_token, pad_token: strings, as chat templates see them.
        self._special = {k: v for k, v in special_tokens.items() if v is not None}
        self._eos_ids = tuple(dict.fromkeys(eos_token_ids))
        self.chat_template = chat_template
        bos = self._special.get("bos_token")
        self._bos_id = backend.token_to_id(bos) if bos is not None else None

    @staticmethod
    def from_path(path: str, *, allow_special_tokens_in_messages: bool = False) -> "Tokenizer":
        """Load from an HF folder (`tokenizer.json` + `tokenizer_config.json`) or a `.gguf` file.

        `allow_special_tokens_in_messages`: `encode_chat` lets text inside messages that spells
        a special token become that token (what encoding the rendered text does); off, it is
        encoded as text.
        """
        if os.path.isdir(path):
            tok = _from_hf_folder(path)
        elif os.path.isfile(path) and path.endswith(".gguf"):
            tok = _from_gguf(path)
        else:
            raise TokenizerError(f"tokenizer path {path!r} is neither a folder nor a .gguf file")
        tok.allow_special_tokens_in_messages = allow_special_tokens_in_messages
        return tok

    # ---- properties ---------------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self._name

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos_ids

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_id

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def backend(self) -> BackendTokenizer:
        return self._backend

    @property
    def max_token_bytes(self) -> int:
        """The most bytes of text one token spells (the vocabulary's longest token, special
        tokens included): a text of B bytes encodes to at least B / max_token_bytes tokens."""
        return self._max_token_bytes

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    # ---- text <-> ids -------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids; special-token text (e.g. `<|im_start|>`) always maps to its single id.

        `add_special_tokens` controls only what the post-processor adds (a BOS, for models that
        want one), like transformers' flag of the same name.
        """
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        encs = self._backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        return [e.ids for e in encs]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # ---- chat ---------------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True, **template_kwargs: Any) -> str:
        """Render `messages` with the model's chat template, as transformers'
        `apply_chat_template(messages, tokenize=False, add_generation_prompt=...)` does."""
        if not self.chat_template:
            raise ChatTemplateError(f"tokenizer {self._name!r} has no chat template")
        # transformers drops None-valued keys (OpenAI clients send content=None on tool calls);
        # templates test for a key's presence, so a None would render as "None".
        msgs = [{k: v for k, v in m.items() if v is not None} for m in messages]
        variables = {**self._special, **template_kwargs}
        try:
            return _compile(self.chat_template).render(
                messages=msgs, add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template of {self._name!r}: {e}") from e

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    **template_kwargs: Any) -> list[int]:
        """The ids of `messages` rendered with the chat template; the template's own control
        tokens (`<|im_start|>`, ...) are special tokens, and text in a message's content that
        spells one is encoded as the text it is, unless `allow_special_tokens_in_messages`.

        Content without such text gives exactly `encode(apply_chat_template(...),
        add_special_tokens=False)`. Otherwise spelled special tokens become stand-ins (private-use
        characters around a per-call nonce) before rendering; the rendered text is cut at the
        special tokens left (the template's), and each piece, stand-ins put back, is encoded with
        special-token matching off: the ids the backend gives a piece between special tokens. A
        template that rewrites content (e.g. `upper`) may hide the stand-ins: they are then
        encoded as the characters they are, never as a special token.
        """
        if self.allow_special_tokens_in_messages or self._specials is None:
            return self.encode(self.apply_chat_template(messages, add_generation_prompt,
                                                        **template_kwargs),
                               add_special_tokens=False)
        nonce = secrets.token_hex(8)
        spelled: list[str] = []

        def stand_in(m: re.Match) -> str:
            spelled.append(m.group(0))
            return f"\ue000{nonce}.{len(spelled) - 1}\ue001"

        msgs = [{**m, "content": self._specials.sub(stand_in, m["content"])}
                if isinstance(m.get("content"), str) else m for m in messages]
        text = self.apply_chat_template(msgs, add_generation_prompt, **template_kwargs)
        if not spelled:
            return self.encode(text, add_special_tokens=False)
        back = re.compile(f"\ue000{nonce}\\.(\\d+)\ue001")
        as_text = self._text_backend()

        def piece(start: int, end: int) -> list[int]:
            if start >= end:
                return []
            plain = back.sub(lambda m: spelled[int(m.group(1))], text[start:end])
            return as_text.encode(plain, add_special_tokens=False).ids

        ids: list[int] = []
        pos = 0
        for m in self._specials.finditer(text):
            ids += piece(pos, m.start())
            ids.append(self._backend.token_to_id(m.group(0)))
            pos = m.end()
        return ids + piece(pos, len(text))

    def _text_backend(self) -> BackendTokenizer:
        if self._as_text is None:  # two threads may both build one: either copy serves
            copy = BackendTokenizer.from_str(self._backend.to_str())
            copy.encode_special_tokens = True
            self._as_text = copy
        return self._as_text


# ---- chat template environment --------------------------------------------------------------


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` renders its body; transformers uses the tag to
    mark assistant tokens for training masks, which serving does not need."""

    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes `<>&'`, which would change prompts; transformers overrides it.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    # Same environment options as transformers: trim_blocks and lstrip_blocks change whitespace.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template does not parse: {e}") from e


def _max_token_bytes(backend: BackendTokenizer) -> int:
    """The longest token's length in bytes of text. Byte-level vocabularies spell each byte as
    one character of GPT-2's alphabet; others spell text as it is (a SentencePiece `▁` or a
    `<0x0A>` byte token counts longer than the text it stands for: an overestimate, still a
    ceiling). Added tokens are matched in the raw text: their UTF-8 length."""
    byte_level = isinstance(backend.decoder, decoders.ByteLevel)
    longest = 1
    for token in backend.get_vocab(with_added_tokens=False):
        longest = max(longest, len(token) if byte_level else len(token.encode("utf-8")))
    for added in backend.get_added_tokens_decoder().values():
        longest = max(longest, len(added.content.encode("utf-8")))
    return longest


# ---- HF folders ---------------------------------------------------------------------------


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _from_hf_folder(path: str) -> Tokenizer:
    tok_file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tok_file):
        raise TokenizerError(f"{path!r} has no tokenizer.json")
    backend = BackendTokenizer.from_file(tok_file)
    cfg = _read_json(os.path.join(path, "tokenizer_config.json"))
    special = {k: _token_text(cfg.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}

    template = cfg.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default")
    jinja_file = os.path.join(path, "chat_template.jinja")  # transformers >= 4.50 saves it apart
    if os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            template = f.read()

    eos_ids: list[int] = []
    if special["eos_token"] is not None:
        eos_id = backend.token_to_id(special["eos_token"])
        if eos_id is None:
            raise TokenizerError(f"{path!r}: eos_token {special['eos_token']!r} is not in the vocabulary")
        eos_ids.append(eos_id)
    # HF generate stops on generation_config's eos ids (Llama-3 lists <|eot_id|> there), so we do too.
    gen_eos = _read_json(os.path.join(path, "generation_config.json")).get("eos_token_id")
    eos_ids += gen_eos if isinstance(gen_eos, list) else ([gen_eos] if gen_eos is not None else [])
    return Tokenizer(backend, name=os.path.basename(os.path.normpath(path)), special_tokens=special,
                     eos_token_ids=eos_ids, chat_template=template)


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


# ---- GGUF files -----------------------------------------------------------------------------

# Split regexes by `tokenizer.ggml.pre`, as transformers' GGUF converter has them. Any other value
# (e.g. "smollm", "gpt2", "default") gets the GPT-2 ByteLevel regex, again as transformers does;
# note llama.cpp splits digits one by one for "smollm", so llama.cpp itself can differ on digits.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
}
_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED = 3, 4


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the spelling of byte-level BPE vocabularies)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def _from_gguf(path: str) -> Tokenizer:
    meta = read_gguf_header(path).metadata
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise TokenizerError(
            f"{path!r}: GGUF tokenizer model {model!r} is not supported (only byte-level BPE, 'gpt2')")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = meta.get("tokenizer.ggml.merges")
    if merges is None:
        raise TokenizerError(f"{path!r}: byte-level BPE GGUF has no tokenizer.ggml.merges")

    # Tokens outside the byte alphabet are respelled byte by byte, as transformers does.
    alphabet = _byte_alphabet()
    chars = set(alphabet.values())
    spelled = [t if set(t) <= chars else "".join(alphabet[b] for b in t.encode("utf-8")) for t in tokens]
    backend = BackendTokenizer(BPE(
        vocab={t: i for i, t in enumerate(spelled)}, merges=[tuple(m.split(" ")) for m in merges],
        dropout=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
    split = _PRE_SPLITS.get(meta.get("tokenizer.ggml.pre"))
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()

    def token(key: str) -> str | None:
        idx = meta.get(f"tokenizer.ggml.{key}")
        return tokens[idx] if idx is not None and 0 <= idx < len(tokens) else None

    special = {"bos_token": token("bos_token_id"), "eos_token": token("eos_token_id"),
               "unk_token": token("unknown_token_id"), "pad_token": token("padding_token_id")}
    # Control tokens are special: matched whole in text, dropped by skip_special_tokens. A control
    # token spelled outside the byte alphabet is a llama.cpp mislabel; transformers skips those.
    control = [t for t, ty in zip(tokens, types) if ty == _TOKEN_TYPE_CONTROL and set(t) <= chars]
    control += [t for t in special.values() if t is not None and t not in control]
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    user = [t for t, ty in zip(tokens, types) if ty == _TOKEN_TYPE_USER_DEFINED and set(t) <= chars]
    if user:
        backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])

    bos, eos = special["bos_token"], special["eos_token"]
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    single = " ".join(([f"{bos}:0"] if add_bos else []) + ["$A:0"] + ([f"{eos}:0"] if add_eos else []))
    pair = single + " " + " ".join(
        ([f"{bos}:1"] if add_bos else []) + ["$B:1"] + ([f"{eos}:1"] if add_eos else []))
    backend.post_processor = processors.TemplateProcessing(
        single=single, pair=pair,
        special_tokens=[(t, meta[f"tokenizer.ggml.{k}_token_id"])
                        for t, k, on in ((bos, "bos", add_bos), (eos, "eos", add_eos)) if on])

    # End-of-generation ids: EOS, plus llama.cpp's EOT/EOM where the file names them (Llama 3).
    eos_ids = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                 "tokenizer.ggml.eom_token_id") if k in meta]
    return Tokenizer(backend, name=os.path.basename(path)[: -len(".gguf")], special_tokens=special,
                     eos_token_ids=eos_ids, chat_template=meta.get("tokenizer.chat_template"))

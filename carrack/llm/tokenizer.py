"""Tokenizers read from GGUF metadata (tokenizer.ggml.*), with llama.cpp's algorithms.

- "llama" (SentencePiece style): the text gets a leading space when add_space_prefix, spaces become U+2581, and
  adjacent symbols (UTF-8 characters at first) are merged highest score first (ties: leftmost); a symbol that is no
  token falls back to its <0xXX> byte tokens.
- "gpt2" (byte-level BPE): the text is split by the pre-tokenizer regexes tokenizer.ggml.pre names, each piece's
  UTF-8 bytes are mapped to GPT-2's printable characters, and adjacent symbols are merged lowest merge rank first.

Control and user-defined tokens written in the text are matched first (user-defined always, control tokens when
`parse_special`), as llama.cpp's tokenizer_st_partition does. `StreamDecoder` turns a stream of token ids into text
without ever splitting a UTF-8 character.
"""

from __future__ import annotations

import codecs
import heapq
import re
from collections.abc import Iterable, Sequence
from typing import Any

from carrack.errors import InvalidModel, UnsupportedModel

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_SPM_SPACE = "\u2581"

_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_REGEX = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
                 r"|\s+(?!\S)|\s+")
_QWEN2_REGEX = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
                r"|\s+(?!\S)|\s+")
_DEFAULT_REGEXES = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2_REGEX, r"\p{N}+", r"[0-9][0-9][0-9]")

# tokenizer.ggml.pre -> (regexes applied one after the other, ignore_merges), as llama.cpp's llama-vocab.cpp
PRE_TOKENIZERS: dict[str, tuple[tuple[str, ...], bool]] = {
    "default": (_DEFAULT_REGEXES, False),
    "llama3": ((_LLAMA3_REGEX,), True),
    "llama-v3": ((_LLAMA3_REGEX,), True),
    "llama-bpe": ((_LLAMA3_REGEX,), True),
    "qwen2": ((_QWEN2_REGEX,), False),
    "deepseek-r1-qwen": ((_QWEN2_REGEX,), False),
    "gpt-2": ((_GPT2_REGEX,), False),
    "phi-2": ((_GPT2_REGEX,), False),
}


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map of the 256 byte values to printable characters."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


_BYTE_ENCODER = bytes_to_unicode()
_BYTE_DECODER = {c: b for b, c in _BYTE_ENCODER.items()}


class Tokenizer:
    """Encodes text to token ids and ids to bytes, from a GGUF file's tokenizer.ggml.* metadata."""

    def __init__(self, metadata: dict[str, Any], where: str = "GGUF"):
        self.model = metadata.get("tokenizer.ggml.model")
        if self.model is None:
            raise InvalidModel(f"{where}: no tokenizer.ggml.model key: the file has no tokenizer (run from token ids)")
        if self.model not in ("llama", "gpt2"):
            raise UnsupportedModel(f"{where}: tokenizer model '{self.model}' is not supported (supported: llama, "
                                   "gpt2)")
        tokens = metadata.get("tokenizer.ggml.tokens")
        if tokens is None or len(tokens) == 0:
            raise InvalidModel(f"{where}: tokenizer.ggml.tokens is missing or empty")
        self.tokens: list[str] = [str(t) for t in tokens]
        n = len(self.tokens)
        self.types = [int(t) for t in metadata.get("tokenizer.ggml.token_type", [NORMAL] * n)]
        self.scores = [float(s) for s in metadata.get("tokenizer.ggml.scores", [0.0] * n)]
        if len(self.types) < n or len(self.scores) < n:
            raise InvalidModel(f"{where}: tokenizer.ggml.token_type / scores have fewer entries than the {n} tokens")
        self.token_to_id = {t: i for i, t in enumerate(self.tokens)}
        spm = self.model == "llama"
        self.bos_id = _token_id(metadata, "bos", 1 if spm else None, n)
        self.eos_id = _token_id(metadata, "eos", 2 if spm else None, n)
        self.unk_id = _token_id(metadata, "unknown", 0 if spm else None, n)
        self.eot_id = _token_id(metadata, "eot", None, n)
        self.add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", spm))
        self.add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
        self.add_space_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", spm))
        self.chat_template: str | None = metadata.get("tokenizer.chat_template")
        self.eog_ids = {i for i in (self.eos_id, self.eot_id) if i is not None}
        self._special = _special_matcher(self.tokens, self.types)
        if spm:
            self._byte_ids = {b: self.token_to_id.get(f"<0x{b:02X}>") for b in range(256)}
        else:
            self._init_bpe(metadata, where)

    def _init_bpe(self, metadata: dict[str, Any], where: str) -> None:
        import regex

        merges = metadata.get("tokenizer.ggml.merges")
        if merges is None:
            raise InvalidModel(f"{where}: a gpt2 tokenizer needs tokenizer.ggml.merges")
        self.ranks: dict[tuple[str, str], int] = {}
        for rank, merge in enumerate(merges):
            first, sep, second = str(merge).partition(" ")
            if not sep:
                raise InvalidModel(f"{where}: merge {rank} ('{merge}') is not two symbols separated by a space")
            self.ranks[(first, second)] = rank
        pre = str(metadata.get("tokenizer.ggml.pre", "default"))
        if pre not in PRE_TOKENIZERS:
            raise UnsupportedModel(f"{where}: pre-tokenizer '{pre}' (tokenizer.ggml.pre) is not supported "
                                   f"(supported: {', '.join(sorted(PRE_TOKENIZERS))})")
        expressions, self.ignore_merges = PRE_TOKENIZERS[pre]
        self.pre = pre
        self._pre_regexes = [regex.compile(e) for e in expressions]

    @property
    def n_vocab(self) -> int:
        return len(self.tokens)

    # ---------------------------------------------------------------------------------------------------------
    # encode

    def encode(self, text: str | bytes, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Token ids of `text`; BOS/EOS as the file says when `add_special`; control tokens written in the text
        are recognised only when `parse_special` (user-defined ones always)."""
        if isinstance(text, bytes | bytearray):
            text = bytes(text).decode("utf-8", errors="replace")
        ids: list[int] = []
        if add_special and self.add_bos and self.bos_id is not None:
            ids.append(self.bos_id)
        previous_special = True
        for fragment, token in self._partition(text, parse_special):
            if token is not None:
                ids.append(token)
                previous_special = True
                continue
            if self.model == "llama":
                prefix = " " if self.add_space_prefix and previous_special else ""
                ids.extend(self._encode_spm((prefix + fragment).replace(" ", _SPM_SPACE)))
            else:
                ids.extend(self._encode_bpe(fragment))
            previous_special = False
        if add_special and self.add_eos and self.eos_id is not None:
            ids.append(self.eos_id)
        return ids

    def _partition(self, text: str, parse_special: bool) -> Iterable[tuple[str, int | None]]:
        if self._special is None:
            if text:
                yield text, None
            return
        pattern, ids, control = self._special
        pos = 0
        for match in pattern.finditer(text):
            token = ids[match.group()]
            if token in control and not parse_special:
                continue
            if match.start() > pos:
                yield text[pos:match.start()], None
            yield match.group(), token
            pos = match.end()
        if pos < len(text):
            yield text[pos:], None

    def _encode_spm(self, text: str) -> list[int]:
        symbols = list(text)
        merged_from: dict[str, tuple[str, str]] = {}
        pieces = _merge_symbols(symbols, lambda a, b: self._spm_score(a, b, merged_from))
        ids: list[int] = []
        for piece in pieces:
            self._spm_resegment(piece, merged_from, ids)
        return ids

    def _spm_score(self, left: str, right: str, merged_from: dict[str, tuple[str, str]]) -> float | None:
        token = self.token_to_id.get(left + right)
        if token is None:
            return None
        merged_from[left + right] = (left, right)
        return -self.scores[token]  # heap pops the smallest: highest score first

    def _spm_resegment(self, piece: str, merged_from: dict[str, tuple[str, str]], out: list[int]) -> None:
        token = self.token_to_id.get(piece)
        if token is not None:
            out.append(token)
            return
        if piece in merged_from:
            left, right = merged_from[piece]
            self._spm_resegment(left, merged_from, out)
            self._spm_resegment(right, merged_from, out)
            return
        for byte in piece.encode("utf-8"):
            byte_id = self._byte_ids.get(byte)
            if byte_id is not None:
                out.append(byte_id)
            elif self.unk_id is not None:
                out.append(self.unk_id)

    def pre_tokenize(self, text: str) -> list[str]:
        """The pieces the pre-tokenizer regexes split `text` into (gpt2 tokenizers)."""
        pieces = [text] if text else []
        for expression in self._pre_regexes:
            split: list[str] = []
            for piece in pieces:
                pos = 0
                for match in expression.finditer(piece):
                    if match.start() > pos:
                        split.append(piece[pos:match.start()])
                    if match.end() > match.start():
                        split.append(match.group())
                    pos = max(pos, match.end())
                if pos < len(piece):
                    split.append(piece[pos:])
            pieces = split
        return pieces

    def _encode_bpe(self, text: str) -> list[int]:
        ids: list[int] = []
        for word in self.pre_tokenize(text):
            encoded = "".join(_BYTE_ENCODER[b] for b in word.encode("utf-8"))
            if self.ignore_merges and encoded in self.token_to_id:
                ids.append(self.token_to_id[encoded])
                continue
            for piece in _merge_symbols(list(encoded), self._bpe_rank):
                token = self.token_to_id.get(piece)
                if token is not None:
                    ids.append(token)
                else:
                    ids.extend(self.token_to_id[c] for c in piece if c in self.token_to_id)
        return ids

    def _bpe_rank(self, left: str, right: str) -> float | None:
        return self.ranks.get((left, right))

    # ---------------------------------------------------------------------------------------------------------
    # decode

    def token_to_piece(self, token: int, special: bool = False) -> bytes:
        """The bytes of one token (control tokens are empty unless `special`)."""
        if not 0 <= token < self.n_vocab:
            raise ValueError(f"token id {token} is outside the vocabulary (0..{self.n_vocab - 1})")
        kind, text = self.types[token], self.tokens[token]
        if kind == CONTROL:
            return text.encode("utf-8") if special else b""
        if kind == USER_DEFINED:
            return text.encode("utf-8")
        if self.model == "llama":
            if kind == BYTE:
                return bytes([int(text[3:5], 16)])
            if kind == UNKNOWN:
                return text.encode("utf-8") if special else b""
            return text.replace(_SPM_SPACE, " ").encode("utf-8")
        if all(c in _BYTE_DECODER for c in text):
            return bytes(_BYTE_DECODER[c] for c in text)
        return text.encode("utf-8")

    def decode(self, ids: Sequence[int], special: bool = False) -> bytes:
        """The bytes of `ids` (SentencePiece style: the space the encoder put in front is taken off again)."""
        data = b"".join(self.token_to_piece(int(t), special) for t in ids)
        if self.model == "llama" and self.add_space_prefix and data.startswith(b" "):
            data = data[1:]
        return data

    def stream(self, special: bool = False) -> StreamDecoder:
        return StreamDecoder(self, special)

    def is_end_of_generation(self, token: int) -> bool:
        return token in self.eog_ids


class StreamDecoder:
    """Text of a stream of tokens, piece by piece; a UTF-8 character split across tokens is held back until it is
    complete, so no piece ever holds half a character."""

    def __init__(self, tokenizer: Tokenizer, special: bool = False):
        self.tokenizer = tokenizer
        self.special = special
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._first = True

    def push(self, token: int) -> str:
        piece = self.tokenizer.token_to_piece(token, self.special)
        if self._first and piece:
            self._first = False
            if self.tokenizer.model == "llama" and self.tokenizer.add_space_prefix and piece.startswith(b" "):
                piece = piece[1:]
        return self._decoder.decode(piece)

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)


def _merge_symbols(symbols: list[str], priority) -> list[str]:
    """Repeatedly merge the adjacent pair with the lowest `priority(left, right)` (None: not mergeable), leftmost
    first among equals; returns the final symbols. A linked list and a heap with stale entries skipped, as llama.cpp."""
    n = len(symbols)
    if n < 2:
        return symbols
    text = symbols[:]
    prev = list(range(-1, n - 1))
    nxt = list(range(1, n + 1))
    nxt[-1] = -1
    heap: list[tuple[float, int, int, str, str]] = []

    def push(left: int, right: int) -> None:
        if left < 0 or right < 0:
            return
        p = priority(text[left], text[right])
        if p is not None:
            heapq.heappush(heap, (p, left, right, text[left], text[right]))

    for i in range(n - 1):
        push(i, i + 1)
    while heap:
        _, left, right, left_text, right_text = heapq.heappop(heap)
        if text[left] != left_text or text[right] != right_text or nxt[left] != right:
            continue  # stale: one side has been merged since
        text[left] = left_text + right_text
        text[right] = ""
        nxt[left] = nxt[right]
        if nxt[right] >= 0:
            prev[nxt[right]] = left
        nxt[right] = prev[right] = -2
        push(prev[left], left)
        push(left, nxt[left])
    return [t for i, t in enumerate(text) if nxt[i] != -2]


def _special_matcher(tokens: list[str], types: list[int]):
    special = {t: i for i, (t, k) in enumerate(zip(tokens, types)) if k in (CONTROL, USER_DEFINED) and t}
    if not special:
        return None
    ordered = sorted(special, key=len, reverse=True)  # longest first, as llama.cpp's partition
    pattern = re.compile("|".join(re.escape(t) for t in ordered))
    control = {i for t, i in special.items() if types[i] == CONTROL}
    return pattern, special, control


def _token_id(metadata: dict[str, Any], name: str, default: int | None, n: int) -> int | None:
    value = metadata.get(f"tokenizer.ggml.{name}_token_id", default)
    if value is None or not 0 <= int(value) < n:
        return default if default is not None and default < n else None
    return int(value)

"""String kernels: StringNormalizer, StringConcat, StringSplit, RegexFullMatch, and the n-gram TfIdfVectorizer.

Strings are numpy object arrays of `str`. String ops work element by element through `np.frompyfunc`, since numpy
has no vectorised kernels for Python strings.
"""

from __future__ import annotations

import re

import numpy as np

from carrack.errors import RunFailure
from carrack.ops.registry import Kernel, register


def _strings(values) -> np.ndarray:
    return np.asarray(values, dtype=object)


@register("StringNormalizer", since=10)
class StringNormalizer(Kernel):
    def setup(self) -> None:
        action = self.attr("case_change_action", "NONE")
        if action not in ("NONE", "LOWER", "UPPER"):
            self.fail(f"case_change_action must be NONE, LOWER or UPPER, got {action!r}")
        self.change_case = {"NONE": None, "LOWER": str.lower, "UPPER": str.upper}[action]
        self.case_sensitive = bool(self.attr("is_case_sensitive", 0))
        stopwords = self.attr("stopwords", [])
        self.stopwords = frozenset(stopwords if self.case_sensitive else (w.lower() for w in stopwords))

    def run(self, x):
        if x.ndim == 2 and x.shape[0] != 1 or x.ndim not in (1, 2):
            raise RunFailure(f"StringNormalizer takes a [C] or [1, C] tensor, got shape {x.shape}")
        words = x.reshape(-1)
        if self.stopwords:
            fold = (lambda w: w) if self.case_sensitive else str.lower
            is_stopword = np.frompyfunc(lambda w: fold(w) in self.stopwords, 1, 1)(words)
            words = words[~is_stopword.astype(bool)]
        if self.change_case is not None and words.size:
            words = np.frompyfunc(self.change_case, 1, 1)(words)
        words = _strings(words) if words.size else _strings([""])
        return words.reshape(1, -1) if x.ndim == 2 else words


@register("StringConcat", since=20)
class StringConcat(Kernel):
    def run(self, x, y):
        out = np.empty(np.broadcast_shapes(x.shape, y.shape), dtype=object)
        np.add(x.astype(object), y.astype(object), out=out)
        return out


@register("StringSplit", since=20)
class StringSplit(Kernel):
    def setup(self) -> None:
        self.delimiter = self.attr("delimiter", "") or None  # None: split on runs of whitespace
        self.maxsplit = self.attr("maxsplit", -1)

    def run(self, x):
        flat = x.reshape(-1)
        pieces = [s.split(self.delimiter, self.maxsplit) for s in flat]
        counts = np.array([len(p) for p in pieces], dtype=np.int64)
        width = int(counts.max()) if counts.size else 0
        out = np.full((flat.size, width), "", dtype=object)
        rows = np.repeat(np.arange(flat.size), counts)
        cols = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
        out[rows, cols] = _strings([p for ps in pieces for p in ps])
        return out.reshape(*x.shape, width), counts.reshape(x.shape)


@register("RegexFullMatch", since=20)
class RegexFullMatch(Kernel):
    def setup(self) -> None:
        pattern = self.required_attr("pattern")
        try:
            self.regex = re.compile(pattern)
        except re.error as e:
            self.fail(f"pattern {pattern!r} is not a valid regular expression: {e}")
        self.matches = np.frompyfunc(lambda s: self.regex.fullmatch(s) is not None, 1, 1)

    def run(self, x):
        return np.asarray(self.matches(x), dtype=np.bool_).reshape(x.shape)


@register("TfIdfVectorizer", since=9)
class TfIdfVectorizer(Kernel):
    """Counts pool n-grams (with up to max_skip_count skipped tokens between members) per row."""

    def setup(self) -> None:
        self.mode = self.required_attr("mode")
        if self.mode not in ("TF", "IDF", "TFIDF"):
            self.fail(f"mode must be TF, IDF or TFIDF, got {self.mode!r}")
        self.min_n = self.required_attr("min_gram_length")
        self.max_n = self.required_attr("max_gram_length")
        self.max_skip = self.required_attr("max_skip_count")
        starts = list(self.required_attr("ngram_counts"))
        indexes = np.asarray(self.required_attr("ngram_indexes"), dtype=np.int64)
        pool_ints, pool_strs = self.attr("pool_int64s"), self.attr("pool_strings")
        if (pool_ints is None) == (pool_strs is None):
            self.fail("exactly one of pool_int64s and pool_strings must be set")
        pool = np.asarray(pool_ints, dtype=np.int64) if pool_ints is not None else _strings(pool_strs)
        self.vocab = np.unique(pool)
        ids = np.searchsorted(self.vocab, pool)
        # Per n: the pool n-grams as an (count, n) array of vocabulary ids, and their n-gram numbers.
        self.levels: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        first_ngram = 0
        for level, start in enumerate(starts):
            n = level + 1
            end = starts[level + 1] if level + 1 < len(starts) else len(pool)
            if (end - start) % n:
                self.fail(f"pool entries {start}..{end} for {n}-grams are not a multiple of {n}")
            count = (end - start) // n
            self.levels[n] = (ids[start:end].reshape(count, n), np.arange(first_ngram, first_ngram + count))
            first_ngram += count
        if len(indexes) != first_ngram:
            self.fail(f"ngram_indexes has {len(indexes)} entries but the pool holds {first_ngram} n-grams")
        self.indexes = indexes
        self.width = int(indexes.max()) + 1 if indexes.size else 0
        weights = self.attr("weights")
        self.weights = np.ones(first_ngram, np.float32) if weights is None else np.asarray(weights, np.float32)

    def run(self, x):
        if x.ndim not in (1, 2):
            raise RunFailure(f"TfIdfVectorizer takes a [C] or [N, C] tensor, got shape {x.shape}")
        rows = x.reshape(1, -1) if x.ndim == 1 else x
        tokens = self._token_ids(rows)
        counts = np.zeros((rows.shape[0], len(self.indexes)), dtype=np.float32)
        for n in range(max(self.min_n, 1), self.max_n + 1):
            if n not in self.levels or not len(self.levels[n][1]):
                continue
            for skip in range(self.max_skip + 1 if n > 1 else 1):
                self._count(tokens, n, skip + 1, counts)
        if self.mode == "IDF":
            counts = (counts > 0).astype(np.float32)
        if self.mode != "TF":
            counts = counts * self.weights
        out = np.zeros((rows.shape[0], self.width), dtype=np.float32)
        out[:, self.indexes] = counts
        return out.reshape(-1) if x.ndim == 1 else out

    def _token_ids(self, rows: np.ndarray) -> np.ndarray:
        """Vocabulary ids of the tokens; -1 for tokens in no pool n-gram."""
        if self.vocab.dtype == object:
            if rows.dtype != object:
                raise RunFailure("TfIdfVectorizer with pool_strings needs a string input")
        elif rows.dtype == object:
            raise RunFailure("TfIdfVectorizer with pool_int64s needs an integer input")
        flat = rows.reshape(-1) if rows.dtype == object else rows.reshape(-1).astype(np.int64)
        if not self.vocab.size:
            return np.full(rows.shape, -1, np.int64)
        pos = np.minimum(np.searchsorted(self.vocab, flat), self.vocab.size - 1)
        return np.where(self.vocab[pos] == flat, pos, -1).reshape(rows.shape)

    def _count(self, tokens: np.ndarray, n: int, stride: int, counts: np.ndarray) -> None:
        span = (n - 1) * stride
        n_windows = tokens.shape[1] - span
        if n_windows <= 0:
            return
        pool_grams, numbers = self.levels[n]
        starts = np.arange(n_windows)
        windows = np.stack([tokens[:, starts + k * stride] for k in range(n)], axis=-1).reshape(-1, n)
        row_of = np.repeat(np.arange(tokens.shape[0]), n_windows)
        keep = (windows >= 0).all(axis=1)
        windows, row_of = windows[keep], row_of[keep]
        codes = _joint_codes(np.concatenate([pool_grams, windows]))
        pool_codes, window_codes = codes[:len(pool_grams)], codes[len(pool_grams):]
        order = np.argsort(pool_codes, kind="stable")
        pos = np.minimum(np.searchsorted(pool_codes[order], window_codes), len(order) - 1)
        found = pool_codes[order][pos] == window_codes
        np.add.at(counts, (row_of[found], numbers[order[pos[found]]]), 1.0)


def _joint_codes(grams: np.ndarray) -> np.ndarray:
    """One integer per row of an (m, n) id array, equal exactly for equal rows (dense, so it cannot overflow)."""
    code = np.zeros(len(grams), dtype=np.int64)
    base = int(grams.max()) + 2 if grams.size else 1
    for k in range(grams.shape[1]):
        _, code = np.unique(code * base + grams[:, k] + 1, return_inverse=True)
        code = code.reshape(-1).astype(np.int64)
    return code


@register("Tokenizer", domain="com.microsoft")
class Tokenizer(Kernel):
    """onnxruntime's Tokenizer (skl2onnx's text vectorizers emit it): each string of a [C] or [N, C] tensor becomes a
    row of tokens, padded with `pad_value` to the longest row: [C, D] or [N, C, D]. Tokens are the pieces between
    matches of the `separators` regular expressions, or the matches of `tokenexp`, scanned left to right; tokens
    shorter than `mincharnum` are dropped; `mark` wraps each row in 0x02 ... 0x03 unless no row has a token. An empty
    separator or the tokenexp "." splits into characters."""

    def setup(self) -> None:
        self.mark = bool(self.required_attr("mark"))
        self.pad = _text(self.required_attr("pad_value"))
        self.min_chars = int(self.required_attr("mincharnum"))
        separators = [_text(s) for s in self.attr("separators", []) or []]
        token = self.attr("tokenexp")
        if bool(separators) == (token is not None):
            self.fail("exactly one of the separators and tokenexp attributes must be set")
        if (separators == [""] or token in (".", b".")) and self.min_chars > 1:
            self.fail(f"mincharnum {self.min_chars} drops every token of character tokenization (1 at most)")
        try:
            if token is not None:
                self.split = self._matches(re.compile(_text(token)))
            elif separators == [""]:
                self.split = list
            else:
                self.split = self._between(re.compile("|".join(f"(?:{s})" for s in separators if s)))
        except re.error as e:
            self.fail(f"invalid regular expression: {e}")

    @staticmethod
    def _matches(pattern: re.Pattern):
        return lambda text: [m.group(0) for m in pattern.finditer(text) if m.group(0)]

    @staticmethod
    def _between(pattern: re.Pattern):
        return lambda text: pattern.split(text)

    def run(self, x):
        if x.ndim not in (1, 2):
            self.fail(f"input must be [C] or [N, C] strings, got shape {x.shape}")
        if x.size == 0:
            return np.empty(x.shape, dtype=object)
        rows = [[t for t in self.split(s) if len(t) >= self.min_chars] for s in x.reshape(-1)]
        if self.mark and any(rows):  # (no token anywhere: an empty last axis, without marks)
            rows = [["\x02", *r, "\x03"] for r in rows]
        width = max(len(r) for r in rows)
        out = np.full((len(rows), width), self.pad, dtype=object)
        for i, r in enumerate(rows):
            out[i, :len(r)] = r
        return out.reshape(x.shape + (width,))


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)

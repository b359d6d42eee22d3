"""Bounded fuzzing of the GGUF reader: mutated valid files either read cleanly (and their tensors can be touched) or
raise GGUFError; nothing else, no hang. Seeded so failures reproduce; a few seconds in all."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from carrack.errors import UnsupportedModel
from carrack.gguf import GGUFError, GGUFFile
from tests.gguf import ARRAY, FLOAT32, STRING, U64_MAX, UINT8, UINT64, simple_raw_file, write_with_gguf_py

EXTREMES = [0, 1, 2, 3, 4, 5, 8, 9, 12, 13, 31, 32, 255, 2**16, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63, U64_MAX]


def _seed_files(tmp_path_factory) -> list[bytes]:
    path = tmp_path_factory.mktemp("fuzz") / "seed.gguf"
    meta = [
        ("s", "text", STRING),
        ("arr", ["a", "bc", ""], ARRAY, STRING),
        ("u", [1, 2, 3], ARRAY, UINT8),
        ("nested", [[1, 2], [3]], ARRAY),
        ("f", 0.5, FLOAT32),
        ("big", 2**40, UINT64),
    ]
    tensors = [
        ("w", np.ones((3, 4), np.float32), None),
        ("i", np.arange(5, dtype=np.int8), None),
        ("h", np.arange(6, dtype=np.float16).reshape(3, 2), None),
        ("q", np.zeros((2, 34), np.uint8), 8),
    ]
    seeds = []
    for big_endian in (False, True):
        write_with_gguf_py(path, tensors, metadata=meta, big_endian=big_endian, alignment=8)
        seeds.append(path.read_bytes())
    seeds.append(simple_raw_file().tobytes())  # has an INT32 array and no general.alignment
    return seeds


@pytest.fixture(scope="module")
def seeds(tmp_path_factory) -> list[bytes]:
    return _seed_files(tmp_path_factory)


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("mutants")


def read_and_touch(path) -> None:
    """Reads the file and touches everything it exposes; only GGUFError may escape."""
    try:
        f = GGUFFile(path)
    except GGUFError:
        return
    with f:
        assert isinstance(f.metadata, dict)
        for t in f.tensors.values():
            raw = t.raw()
            assert raw.nbytes == t.nbytes and t.offset + t.nbytes <= f.file_size
            int(raw[:16].sum())
            try:
                data = t.data()
            except UnsupportedModel:
                assert t.type.is_quantized
            else:
                assert data.shape == t.shape


def _write(tmp_path, data: bytes):
    path = tmp_path / "mutant.gguf"
    path.unlink(missing_ok=True)  # a new inode: mappings of the previous mutant stay valid
    path.write_bytes(data)
    return path


def _mutate(data: bytes, rng: np.random.Generator) -> bytes:
    buf = bytearray(data)
    kind = rng.integers(0, 5) if len(buf) > 16 else 4
    if kind == 0:  # flip a few bytes
        for _ in range(rng.integers(1, 5)):
            buf[rng.integers(0, len(buf))] ^= int(rng.integers(1, 256))
    elif kind == 1:  # an extreme little- or big-endian integer somewhere in the header
        value = EXTREMES[rng.integers(0, len(EXTREMES))]
        width = 8 if rng.integers(0, 2) else 4
        pos = int(rng.integers(4, min(len(buf), 400) - width))
        buf[pos : pos + width] = (value % (1 << (8 * width))).to_bytes(width, "little" if rng.integers(0, 2) else "big")
    elif kind == 2:  # truncate
        del buf[rng.integers(0, len(buf)) :]
    elif kind == 3:  # delete a chunk
        start = int(rng.integers(0, len(buf)))
        del buf[start : start + int(rng.integers(1, 16))]
    else:  # insert random bytes
        start = int(rng.integers(0, len(buf) + 1))
        buf[start:start] = rng.integers(0, 256, int(rng.integers(1, 16)), dtype=np.uint8).tobytes()
    return bytes(buf)


def test_random_mutations(tmp_path, seeds):
    rng = np.random.default_rng(20240607)
    for i in range(8000):
        data = seeds[i % len(seeds)]
        for _ in range(rng.integers(1, 4)):
            data = _mutate(data, rng)
        read_and_touch(_write(tmp_path, data))


@settings(max_examples=400, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(
    which=st.integers(0, 2),
    edits=st.lists(st.tuples(st.integers(0, 399), st.sampled_from(EXTREMES), st.sampled_from([1, 4, 8])), max_size=4),
    cut=st.one_of(st.none(), st.integers(0, 2000)),
)
def test_hypothesis_structured_edits(fuzz_dir, seeds, which, edits, cut):
    buf = bytearray(seeds[which])
    order = "big" if which == 1 else "little"
    for pos, value, width in edits:
        if pos + width <= len(buf):
            buf[pos : pos + width] = (value % (1 << (8 * width))).to_bytes(width, order)
    if cut is not None:
        del buf[cut:]
    read_and_touch(_write(fuzz_dir, bytes(buf)))

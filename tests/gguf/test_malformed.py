"""A corpus of malformed GGUF files, built from valid ones: every one must raise GGUFError naming the problem, quickly
and without allocating more than the file (checked with tracemalloc here and under RLIMIT_AS in a subprocess)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import tracemalloc

import numpy as np
import pytest

from carrack.gguf import GGUFError, GGUFFile
from tests.gguf import (
    ARRAY,
    F32_TYPE,
    FLOAT32,
    INT32,
    Q8_0_TYPE,
    STRING,
    U32_MAX,
    U64_MAX,
    UINT8,
    UINT32,
    UINT64,
    RawGGUF,
    simple_raw_file,
    write_with_gguf_py,
)

BIG = [2**63, U64_MAX]


def check_refused(path, match: str | None = None) -> GGUFError:
    """Reading `path` raises GGUFError (matching `match`) with a peak allocation well under twice the file size."""
    size = os.path.getsize(path)
    tracemalloc.start()
    try:
        with pytest.raises(GGUFError, match=match) as info:
            GGUFFile(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2 * size + 256 * 1024, f"peak allocation {peak} bytes for a {size}-byte file"
    return info.value


def _file(*, n_tensors=2, n_kv=2, version=3, magic=b"GGUF", order="<", kvs=None, infos=None, data=44, align=32):
    """A raw file shaped like simple_raw_file, with any part replaced."""
    raw = RawGGUF(order).header(n_tensors, n_kv, version=version, magic=magic)
    for kv in kvs if kvs is not None else [("general.name", STRING, "tiny"), ("n", UINT32, 2)]:
        raw.kv(*kv[:3], **(kv[3] if len(kv) > 3 else {}))
    for info in infos if infos is not None else [("a", [4, 2], F32_TYPE, 0), ("b", [3], F32_TYPE, 32)]:
        raw.tensor_info(*info)
    return raw.pad(align).data(data).tobytes()


def _nested(depth: int) -> tuple:
    item: tuple = (INT32, [1])
    for _ in range(depth):
        item = (ARRAY, [item])
    return item


def _lie(data: bytes, offset: int, value: int, order: str = "<") -> bytes:
    return data[:offset] + value.to_bytes(8, "little" if order == "<" else "big") + data[offset + 8 :]


CASES: dict[str, tuple[bytes, str]] = {
    "empty": (b"", "shorter than"),
    "short": (b"GGUF\x03\x00\x00\x00\x00", "shorter than"),
    "bad_magic": (_file(magic=b"GGML"), "magic"),
    "lowercase_magic": (_file(magic=b"gguf"), "magic"),
    "v1": (_file(version=1), "version 1"),
    "v1_big_endian": (_file(version=1, order=">"), "version 1"),
    "v4": (_file(version=4), "unsupported GGUF version 4"),
    "v4_big_endian": (_file(version=4, order=">"), "unsupported GGUF version 4"),
    "v0": (_file(version=0), "unsupported GGUF version 0"),
    "v_max": (_file(version=U32_MAX), "unsupported GGUF version"),
    "tensor_count_plus_1": (_file(n_tensors=3), "tensor #2"),
    "kv_count_plus_1": (_file(n_kv=3), ""),
    "kv_count_minus_1": (_file(n_kv=1), ""),
    "no_data_section": (_file(data=0), "runs past the end"),
    "last_tensor_truncated": (_file(data=43), "tensor 'b'.*runs past the end"),
    "key_bad_utf8": (_file(kvs=[(b"k\xff", UINT32, 1), ("n", UINT32, 2)]), "invalid UTF-8"),
    "string_value_bad_utf8": (_file(kvs=[("k", STRING, b"\xc3\x28"), ("n", UINT32, 2)]), "'k'.*invalid UTF-8"),
    "tensor_name_bad_utf8": (_file(infos=[(b"\xfe", [4, 2], F32_TYPE, 0), ("b", [3], F32_TYPE, 32)]), "UTF-8"),
    "duplicate_key": (_file(kvs=[("n", UINT32, 1), ("n", UINT32, 2)]), "duplicate metadata key 'n'"),
    "duplicate_tensor": (_file(infos=[("a", [4, 2], F32_TYPE, 0), ("a", [3], F32_TYPE, 32)]), "'a'.*duplicate"),
    "array_too_deep": (_file(kvs=[("deep", ARRAY, [_nested(70)], {"etype": ARRAY}), ("n", UINT32, 1)]), "nested"),
    "array_of_arrays_truncated": (
        _file(kvs=[("x", ARRAY, [(INT32, [1], 1000)], {"etype": ARRAY}), ("n", UINT32, 1)]),
        "'x'",
    ),
    "row_not_multiple_of_block": (
        _file(infos=[("q", [33], Q8_0_TYPE, 0), ("b", [3], F32_TYPE, 64)], data=80),
        "'q'.*33 is not a multiple of the Q8_0 block size 32",
    ),
    "dim_zero": (_file(infos=[("a", [4, 0], F32_TYPE, 0), ("b", [3], F32_TYPE, 32)]), "'a'.*size 0"),
    "n_dims_5": (_file(infos=[("a", [1, 1, 1, 1, 8], F32_TYPE, 0), ("b", [3], F32_TYPE, 32)]), "'a'.*5 dimensions"),
    "n_dims_huge": (
        _file(infos=[("a", [1] * 4, F32_TYPE, 0), ("b", [3], F32_TYPE, 32)]).replace(
            (4).to_bytes(4, "little") + (1).to_bytes(8, "little"),
            U32_MAX.to_bytes(4, "little") + (1).to_bytes(8, "little"),
            1,
        ),
        "4294967295 dimensions",
    ),
    "dims_product_over_2_64": (_file(infos=[("a", [2**32] * 4, F32_TYPE, 0), ("b", [3], F32_TYPE, 32)]), "overflows"),
    "dims_product_2_64": (_file(infos=[("a", [2**63, 2], F32_TYPE, 0), ("b", [3], F32_TYPE, 32)]), "overflows"),
    "dim_u64_max": (_file(infos=[("a", [U64_MAX], F32_TYPE, 0), ("b", [3], F32_TYPE, 32)]), "overflows"),
    "dims_bigger_than_file": (
        _file(infos=[("a", [2**40, 2**20], F32_TYPE, 0), ("b", [3], F32_TYPE, 32)]),
        "'a'.*exceed the file size",
    ),
    "misaligned_offset": (
        _file(infos=[("a", [4, 2], F32_TYPE, 0), ("b", [3], F32_TYPE, 33)], data=48),
        "'b'.*offset 33 is not a multiple of the alignment 32",
    ),
    "offset_out_of_bounds": (_file(infos=[("a", [4, 2], F32_TYPE, 0), ("b", [3], F32_TYPE, 64)]), "'b'.*past the end"),
    "offset_2_63": (_file(infos=[("a", [4, 2], F32_TYPE, 0), ("b", [3], F32_TYPE, 2**63)]), "'b'.*past the end"),
    "offset_u64_max_aligned": (
        _file(infos=[("a", [4, 2], F32_TYPE, 0), ("b", [3], F32_TYPE, 2**64 - 32)]),
        "'b'.*past the end",
    ),
    "same_offset": (_file(infos=[("a", [4, 2], F32_TYPE, 0), ("b", [3], F32_TYPE, 0)]), "'a'.*'b'.*overlap"),
    "partial_overlap": (_file(infos=[("a", [12], F32_TYPE, 0), ("b", [3], F32_TYPE, 32)], data=48), "overlap"),
    "alignment_0": (_file(kvs=[("general.alignment", UINT32, 0), ("n", UINT32, 1)]), "alignment is 0"),
    "alignment_3": (_file(kvs=[("general.alignment", UINT32, 3), ("n", UINT32, 1)]), "power of two"),
    "alignment_2_40": (_file(kvs=[("general.alignment", UINT64, 2**40), ("n", UINT32, 1)]), "power of two"),
    "alignment_2_31": (_file(kvs=[("general.alignment", UINT32, 2**31), ("n", UINT32, 1)]), "past the end"),
    "alignment_string": (_file(kvs=[("general.alignment", STRING, "32"), ("n", UINT32, 1)]), "must be an integer"),
    "alignment_float": (_file(kvs=[("general.alignment", FLOAT32, 32.0), ("n", UINT32, 1)]), "must be an integer"),
}
for bad_type in (13, 99, U32_MAX):
    CASES[f"value_type_{bad_type}"] = (
        _file(kvs=[("k", bad_type, b"\0" * 8), ("n", UINT32, 1)]),
        f"'k'.*unknown value type {bad_type}",
    )
    CASES[f"array_element_type_{bad_type}"] = (
        _file(kvs=[("k", ARRAY, [], {"etype": bad_type}), ("n", UINT32, 1)]),
        f"'k'.*unknown value type {bad_type}",
    )
for bad_type in (4, 5, 31, 36, 99, U32_MAX):
    CASES[f"ggml_type_{bad_type}"] = (
        _file(infos=[("a", [8], bad_type, 0), ("b", [3], F32_TYPE, 32)]),
        f"'a'.*unknown ggml type id {bad_type}",
    )
for n in BIG:
    for order in "<>":
        CASES[f"tensor_count_{n}{order}"] = (_file(n_tensors=n, order=order), "header declares")
        CASES[f"kv_count_{n}{order}"] = (_file(n_kv=n, order=order), "header declares")
    CASES[f"key_length_{n}"] = (RawGGUF().header(0, 1).pack("Q", n).put(b"k" * 20).tobytes(), "string length")
    CASES[f"string_length_{n}"] = (
        RawGGUF().header(0, 1).string("k").pack("I", STRING).string("abc", length=n).tobytes(),
        "'k'.*string length",
    )
    CASES[f"tensor_name_length_{n}"] = (
        RawGGUF().header(1, 0).string("abcd", length=n).put(b"\0" * 30).tobytes(),
        "tensor #0 name.*string length",
    )
    CASES[f"array_length_u8_{n}"] = (
        _file(kvs=[("k", ARRAY, [1, 2], {"etype": UINT8, "length": n}), ("n", UINT32, 1)]),
        "'k'.*array of",
    )
    CASES[f"array_length_str_{n}"] = (
        _file(kvs=[("k", ARRAY, ["x"], {"etype": STRING, "length": n}), ("n", UINT32, 1)]),
        "'k'.*array of",
    )
    CASES[f"string_in_array_length_{n}"] = (
        RawGGUF()
        .header(0, 1)
        .string("k")
        .pack("I", ARRAY)
        .pack("I", STRING)
        .pack("Q", 1)
        .string("abc", length=n)
        .tobytes(),
        "'k'.*string length",
    )
    CASES[f"nested_array_length_{n}"] = (
        _file(kvs=[("k", ARRAY, [(INT32, [1, 2]), (UINT8, [1], n)], {"etype": ARRAY}), ("n", UINT32, 1)]),
        r"'k'\[1\].*array of",
    )
    CASES[f"outer_nested_array_length_{n}"] = (
        _file(kvs=[("k", ARRAY, [(INT32, [1, 2])], {"etype": ARRAY, "length": n}), ("n", UINT32, 1)]),
        "'k'.*array of",
    )


@pytest.mark.parametrize("name", sorted(CASES))
def test_malformed_file_is_refused(tmp_path, name):
    data, match = CASES[name]
    path = tmp_path / f"{name}.gguf"
    path.write_bytes(data)
    err = check_refused(path, match or None)
    assert str(path) in str(err)


def test_valid_variants_of_the_corpus_base_are_accepted(tmp_path):
    """The corpus is built from files that are valid until broken: the unbroken versions read fine."""
    aligned_64 = _file(
        kvs=[("general.alignment", UINT32, 64), ("n", UINT32, 1)],
        infos=[("a", [4, 2], F32_TYPE, 0), ("b", [3], F32_TYPE, 64)],
        align=64,
        data=76,
    )
    for i, data in enumerate([_file(), _file(order=">"), aligned_64]):
        path = tmp_path / f"ok{i}.gguf"
        path.write_bytes(data)
        f = GGUFFile(path)
        assert list(f.tensors) == ["a", "b"]
        np.testing.assert_array_equal(f.tensors["b"].raw(), np.full(12, 0x3C, np.uint8))


def _truncation_points_of_raw_file() -> tuple[bytes, list[int]]:
    raw = simple_raw_file()
    data = raw.tobytes()
    points = {0, 1, 3, 4, 7, 8}
    for b in raw.boundaries[:-1]:
        points.update({b - 1, b, b + 1})
    return data, sorted(p for p in points if 0 <= p < len(data))


def test_truncated_at_every_boundary_of_a_raw_file(tmp_path):
    data, points = _truncation_points_of_raw_file()
    for p in points:
        path = tmp_path / f"cut{p}.gguf"
        path.write_bytes(data[:p])
        check_refused(path)


@pytest.fixture(scope="module")
def gguf_py_file(tmp_path_factory) -> tuple[bytes, list[int]]:
    """A valid file written by gguf-py and its structural boundaries (from gguf-py's reader), below the data end."""
    gguf = pytest.importorskip("gguf")
    path = tmp_path_factory.mktemp("gguf") / "valid.gguf"
    meta = [
        ("s", "text", STRING),
        ("u", 7, UINT32),
        ("arr", ["a", "bc"], ARRAY, STRING),
        ("nested", [[1, 2], [3]], ARRAY),
        ("f", 0.5, FLOAT32),
    ]
    tensors = [("w", np.ones((3, 4), np.float32), None), ("i", np.arange(5, dtype=np.int8), None)]
    write_with_gguf_py(path, tensors, metadata=meta)
    ref = gguf.GGUFReader(str(path))
    end = max(t.data_offset + t.n_bytes for t in ref.tensors)
    points = set()
    for field in [*ref.fields.values(), *(t.field for t in ref.tensors)]:
        offset = field.offset
        for part in field.parts:
            points.add(offset)
            offset += part.nbytes
    points.update({ref.data_offset, ref.data_offset - 1, end - 1, *(t.data_offset + 1 for t in ref.tensors)})
    return path.read_bytes(), sorted(p for p in points if p < end)


def test_truncated_at_every_field_of_a_gguf_py_file(tmp_path, gguf_py_file):
    data, points = gguf_py_file
    assert len(points) > 30
    for p in points:
        path = tmp_path / f"cut{p}.gguf"
        path.write_bytes(data[:p])
        check_refused(path)


def test_truncated_at_random_points(tmp_path, gguf_py_file):
    data, points = gguf_py_file
    end = points[-1] + 1
    for p in np.random.default_rng(7).integers(0, end, 60):
        path = tmp_path / f"cut{p}.gguf"
        path.write_bytes(data[:p])
        check_refused(path)


@pytest.mark.parametrize("which,offset", [("tensor_count", 8), ("kv_count", 16)])
@pytest.mark.parametrize("delta", [1, 2, 1000, 2**62, U64_MAX])
def test_lying_counts_in_a_gguf_py_file(tmp_path, gguf_py_file, which, offset, delta):
    data, _ = gguf_py_file
    count = int.from_bytes(data[offset : offset + 8], "little")
    path = tmp_path / f"{which}.gguf"
    path.write_bytes(_lie(data, offset, min(count + delta, U64_MAX)))
    check_refused(path)


SUBPROCESS_READER = textwrap.dedent("""
    import json, resource, sys
    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
    from carrack.gguf import GGUFError, GGUFFile
    outcomes = {}
    for path in sys.argv[1:]:
        try:
            GGUFFile(path)
            outcomes[path] = "accepted"
        except GGUFError:
            outcomes[path] = "GGUFError"
        except BaseException as e:  # noqa: BLE001 - reported, not hidden
            outcomes[path] = f"{type(e).__name__}: {e}"
    print(json.dumps(outcomes))
""")


def test_whole_corpus_under_a_2gb_address_space_limit(tmp_path):
    paths = []
    for name, (data, _) in CASES.items():
        path = tmp_path / f"{name}.gguf"
        path.write_bytes(data)
        paths.append(str(path))
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, "-c", SUBPROCESS_READER, *paths], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    outcomes = json.loads(proc.stdout.strip().splitlines()[-1])
    wrong = {os.path.basename(p): o for p, o in outcomes.items() if o != "GGUFError"}
    assert not wrong
    assert len(outcomes) == len(CASES)

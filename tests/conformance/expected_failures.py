"""Conformance cases carrack is known to fail, each with its reason. Keep this list short and honest."""

EXPECTED_FAILURES: dict[str, str] = {
}

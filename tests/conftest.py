"""Suite-wide settings: every rewrite the optimizer makes in a test is followed by a check of the graph's
invariants (values read are defined, outputs produced, nodes orderable)."""

import os

os.environ.setdefault("CARRACK_CHECK_REWRITES", "1")

"""control_flow kernels."""

from __future__ import annotations

"""Transformer-block fusions: LayerNormalization, GELU, SkipLayerNorm and attention from their exported forms."""

from __future__ import annotations

"""Graph passes: shape inference, folding, fusions, memory planning."""

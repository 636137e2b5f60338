"""Long sequences: sequence parallelism, activation offload, and the sequence-tiled loss and MLP (DESIGN.md section 12)."""

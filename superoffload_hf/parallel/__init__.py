"""Long sequences: what keeps a sequence's activations within one device (DESIGN.md section 12)."""

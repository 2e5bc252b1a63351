"""The model: loading it (exact or refused), its layout, the transformers
boundary, its forward and decoding."""

"""Flax NNX decoders (Llama family) on the paged cache. Empty until the models issue lands."""

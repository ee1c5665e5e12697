"""Post-training quantization of torch modules: the error measure (compare)."""

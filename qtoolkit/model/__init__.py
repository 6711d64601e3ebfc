"""The model: one decoder for every supported family, its loaders and sources (HF folder, GGUF), the quantized Linear per scheme and the C++ decode plan."""

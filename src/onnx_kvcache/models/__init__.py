"""The bundled decoders: genai-shaped builds, paged builds and PyTorch-export-shaped graphs."""

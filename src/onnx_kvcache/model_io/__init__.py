"""Models and files in and out, below everything: reading a model, onnxruntime-genai folders, the
converted marker, safe input reads and guarded output writes, and importing onnxruntime."""

"""Files: converting models, files and onnxruntime-genai folders (reading and writing: ``model_io``)."""

"""Files: reading models, converting files and onnxruntime-genai folders, safe input and output files."""

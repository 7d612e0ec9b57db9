"""The bundled decoder: onnxruntime-genai-shaped builds (GQA, PagedAttention), for the demo and
the docs. The exporters' forms the tests imitate are tests/builders/'s."""

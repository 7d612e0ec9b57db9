"""Builders of the graphs exporters write (``torch.onnx.export``, optimum's TorchScript export),
for the tests: test scaffolding, not shipped. ``build_decoder`` here is the library's, plus the
exported forms (``build_decoder(exported_config("llama"))``, ``build_decoder(exported=ExportStyle())``).
"""

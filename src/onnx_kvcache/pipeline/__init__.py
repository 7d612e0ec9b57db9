"""The one decision every entry point takes: fuse, infer the target, gate, quantize."""

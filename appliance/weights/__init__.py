"""Checkpoints: safetensors reading (memory-mapped), quantization into the cached formats, linear layers."""

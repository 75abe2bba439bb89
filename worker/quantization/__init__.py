"""Quantized checkpoints: read the weight formats model makers publish and hand the model
plain tensors in the compute dtype.

A checkpoint says how it is quantized in `config.json`'s `quantization_config`. `methods`
resolves that (and the `quantization` engine argument) to one supported method; `schemes` maps a
method's config to a `WeightScheme` that knows its tensor names and how to dequantize them;
`checkpoint` groups the parts of each quantized tensor (weight, scales, zero points, ...) into
one lazily dequantized `WeightSource`, so every layer's loader, tensor-parallel split, LoRA and
drafter works unchanged. Dequantization happens once, at load.
"""

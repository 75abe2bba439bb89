"""Tensor-parallel building blocks of the model families: linear, embedding, norm, rotary, activation."""

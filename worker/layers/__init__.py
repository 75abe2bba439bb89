"""Tensor-parallel building blocks of the model families.

Linear, embedding, norm, rotary and activation layers, each parameter with its weight loader.
"""

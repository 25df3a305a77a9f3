"""Speculative decoding parts that know no model: draft trees (tree), the lossless acceptance walk
(accept) and the model-free n-gram drafter (ngram). The engine wires them to the target and the
learned drafter.
"""

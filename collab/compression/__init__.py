"""Compression operators and their wire messages (a leaf: imports only torch/numpy and ``collab.rng``)."""

from collab.compression.aggregate import union_support, weighted_mean
from collab.compression.compressors import Compressor, Identity, RandK, TopK, make_compressor, topk_indices
from collab.compression.message import CompressedMessage, MessageFormatError, MessageKind, index_bits
from collab.compression.sampling import random_subset

__all__ = [
    "CompressedMessage",
    "Compressor",
    "Identity",
    "MessageFormatError",
    "MessageKind",
    "RandK",
    "TopK",
    "index_bits",
    "make_compressor",
    "random_subset",
    "topk_indices",
    "union_support",
    "weighted_mean",
]

"""Datasets (bundled MNIST subset, CIFAR-10 python format, image folders, synthetic), batching, augmentation and
the non-IID skew partitioner. Readers need only torch + numpy; image folders also need torchvision."""

from peer.data.loader import BatchLoader
from peer.data.partition import skew_partition
from peer.data.registry import DATASETS, load_dataset
from peer.data.tensors import DatasetError, DatasetSplits, TensorData

__all__ = [
    "DATASETS",
    "BatchLoader",
    "DatasetError",
    "DatasetSplits",
    "TensorData",
    "load_dataset",
    "skew_partition",
]

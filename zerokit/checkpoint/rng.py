"""Every random number generator a rank's training draws from (torch's CPU and CUDA generators, Python's
`random`, numpy's global one), saved per rank and restored on the same rank: dropout masks and random
data order then continue as if training had never stopped."""

from __future__ import annotations

import random
from typing import Any

import numpy
import torch


def capture_rng() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors for the rank file, small values for the manifest)."""
    tensors = {"rng/torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensors["rng/torch_cuda"] = torch.cuda.get_rng_state()
    version, words, gauss = random.getstate()
    tensors["rng/python"] = torch.tensor(words, dtype=torch.int64)
    kind, keys, position, has_gauss, cached = numpy.random.get_state()
    tensors["rng/numpy"] = torch.from_numpy(keys.astype(numpy.int64))
    meta: dict[str, Any] = {"python": [version, gauss], "numpy": [kind, int(position), int(has_gauss), float(cached)]}
    return tensors, meta


def restore_rng(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    torch.set_rng_state(tensors["rng/torch_cpu"])
    if "rng/torch_cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["rng/torch_cuda"])
    version, gauss = meta["python"]
    random.setstate((version, tuple(int(w) for w in tensors["rng/python"].tolist()), gauss))
    if "numpy" in meta and "rng/numpy" in tensors:
        kind, position, has_gauss, cached = meta["numpy"]
        numpy.random.set_state((kind, tensors["rng/numpy"].numpy().astype(numpy.uint32), position, has_gauss, cached))


RNG_KEYS = ("rng/torch_cpu", "rng/torch_cuda", "rng/python", "rng/numpy")

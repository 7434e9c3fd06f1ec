"""Fractal volumes for segmentation: IFS classes, in-situ volume generation, the HDF5 store, loading.

`prepare(data_cfg, scale, seed)` generates (or reuses) the dataset file; `read_info` and `load_masks`
read it; `MaskDataset` and `make_input` turn it into network input. Names are imported on first use,
so generation worker processes never import torch and `python -m scaffold.data.library` runs cleanly.
"""
from importlib import import_module

_HOMES = {"DatasetInfo": "store", "dataset_path": "store", "prepare": "store", "read_info": "store",
          "load_masks": "store", "MaskDataset": "loader", "make_input": "loader"}
__all__ = list(_HOMES)


def __getattr__(name: str):
    if name in _HOMES:
        return getattr(import_module(f".{_HOMES[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""Reading masks for training, and turning them into network input on the device.

The input never travels as floats: the HDF5 file, the DataLoader and the host-to-device copy all carry
uint8 masks (1 byte per voxel); `make_input` expands them to RGB colours (12 bytes per voxel) with one
gather on the device where the network runs.
"""
from __future__ import annotations

import os

import h5py
import torch

from .store import SPLITS


class MaskDataset(torch.utils.data.Dataset):
    """The masks of one split, read one volume at a time; safe with DataLoader worker processes.

    The HDF5 file is opened lazily in each process that reads (an h5py handle must not cross a fork or
    be pickled), and reopened if the dataset object finds itself in a different process.
    """

    def __init__(self, path: os.PathLike | str, split: str):
        if split not in SPLITS:
            raise ValueError(f"split={split!r}: expected one of {', '.join(SPLITS)}")
        self.path = os.fspath(path)
        self.split = split
        with h5py.File(self.path, "r") as f:
            self._length = int(f[f"{split}/masks"].shape[0])
        self._file: h5py.File | None = None
        self._pid: int | None = None

    def __len__(self) -> int:
        return self._length

    def _masks(self) -> h5py.Dataset:
        if self._file is None or self._pid != os.getpid():
            self._file = h5py.File(self.path, "r")
            self._pid = os.getpid()
        return self._file[f"{self.split}/masks"]

    def __getitem__(self, index: int) -> torch.Tensor:
        if not -self._length <= index < self._length:
            raise IndexError(f"volume {index} out of range for {self._length} {self.split} volumes")
        return torch.from_numpy(self._masks()[index % self._length])

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_file"], state["_pid"] = None, None
        return state


def make_input(masks: torch.Tensor, palette: torch.Tensor) -> torch.Tensor:
    """palette[mask]: uint8/int (N, D, H, W) masks and a float (C, 3) palette on the same device ->
    float32 (N, 3, D, H, W). One gather, no host synchronisation. On CUDA the result is
    channels_last_3d (the gather writes NDHWC and is viewed as NCDHW); on CPU it is contiguous."""
    if masks.dim() != 4:
        raise ValueError(f"masks: expected (N, D, H, W), got shape {tuple(masks.shape)}")
    if palette.dim() != 2 or palette.shape[1] != 3:
        raise ValueError(f"palette: expected (C, 3), got shape {tuple(palette.shape)}")
    # uint8 index tensors would be read as boolean masks by advanced indexing: gather with int32/64.
    index = masks if masks.dtype in (torch.int32, torch.int64) else masks.to(torch.int32)
    colours = torch.index_select(palette.to(torch.float32), 0, index.reshape(-1))
    ndhwc = colours.reshape(*masks.shape, 3)
    ncdhw = ndhwc.permute(0, 4, 1, 2, 3)
    return ncdhw if ncdhw.is_cuda else ncdhw.contiguous()

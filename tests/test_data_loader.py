"""Network input from masks (palette[mask]) and the DataLoader-safe mask dataset."""
import pickle

import numpy as np
import pytest
import torch

from scaffold.config import DataConfig
from scaffold.data import MaskDataset, load_masks, make_input, prepare


def test_make_input_is_the_palette_gathered_by_label():
    generator = torch.Generator().manual_seed(0)
    masks = torch.randint(0, 4, (2, 3, 4, 5), generator=generator, dtype=torch.uint8)
    palette = torch.rand(4, 3, generator=generator)
    palette[0] = 0
    expected = palette[masks.long()].permute(0, 4, 1, 2, 3)
    for index in (masks, masks.long(), masks.int()):
        image = make_input(index, palette)
        assert image.shape == (2, 3, 3, 4, 5) and image.dtype == torch.float32
        assert image.is_contiguous()
        assert torch.equal(image, expected)
    assert torch.equal(image[1, :, 2, 3, 4], palette[masks[1, 2, 3, 4].long()])


def test_make_input_rejects_wrong_shapes():
    with pytest.raises(ValueError, match=r"masks: expected \(N, D, H, W\)"):
        make_input(torch.zeros(4, 4, 4, dtype=torch.uint8), torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"palette: expected \(C, 3\)"):
        make_input(torch.zeros(1, 4, 4, 4, dtype=torch.uint8), torch.zeros(2, 4))


@pytest.mark.gpu
def test_make_input_is_channels_last_on_cuda():
    masks = torch.randint(0, 3, (1, 8, 8, 8), dtype=torch.uint8, device="cuda")
    palette = torch.rand(3, 3, device="cuda")
    image = make_input(masks, palette)
    assert image.is_contiguous(memory_format=torch.channels_last_3d)
    assert torch.equal(image.cpu(), make_input(masks.cpu(), palette.cpu()))


def test_mask_dataset_with_two_loader_workers(tmp_path):
    cfg = DataConfig(cache_dir=str(tmp_path), workers=1, n_categories=3, n_instances=12)
    path = prepare(cfg, 3, 5, progress=False)
    dataset = MaskDataset(path, "train")
    assert len(dataset) == 8
    first = dataset[0]  # opens the file in this process; workers must not inherit the handle
    assert first.dtype == torch.uint8 and first.shape == (8, 8, 8)
    assert pickle.loads(pickle.dumps(dataset))._file is None
    loader = torch.utils.data.DataLoader(dataset, batch_size=3, num_workers=2, shuffle=False)
    batches = torch.cat(list(loader))
    assert np.array_equal(batches.numpy(), load_masks(path, "train"))
    with pytest.raises(IndexError):
        dataset[8]

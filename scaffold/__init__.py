"""scaffold: 3D U-Net segmentation training on in-situ fractal volumes, reproducible bit for bit."""

__version__ = "0.1.0"

"""edgelin: ship trained linear-attention models to edge devices."""

__version__ = "0.1.0"

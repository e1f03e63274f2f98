"""Serving exports on existing inference servers (`edgelin export --serve triton`: edgelin.serve.triton)."""

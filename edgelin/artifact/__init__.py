"""The artifact contract: what an exported folder holds and how it is read, torch-free. The export side
writes these formats and the run side (runners, validate, bench, generate, serve) reads them; neither
imports the other.

  manifest           manifest.json (Manifest), the graphs' tensors (tensors) and state names (state)
  reference_vectors  reference.npz: its keys, thresholds and reading (replayed by `validate DIR`)
  quality            the quality figures' records: reference, figures, bounds, checks, the export gate's
  baselines          the baselines exported inside a folder (`--baseline kv`) and where bench finds them
  quantized          an export's quantised weights read back to float (the dequantised parity reference)
"""

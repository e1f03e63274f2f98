"""The artifact contract: what an exported folder holds and how it is read (the manifest, tensor and
state names, reference vectors, quality records, baselines). Torch-free: the export side writes these
formats and the run side (runners, validate, bench, generate, serve) reads them; neither imports the
other."""

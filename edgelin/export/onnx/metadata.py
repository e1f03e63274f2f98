"""The ONNX graphs' metadata_props entries the runner reads (written by the export): shared by the target
and the torch-free runner, so neither imports the other."""

IN_PLACE_KEY = "edgelin.in_place_states"  # the step graph's entry: past input names, comma-separated
KV_CAPACITY_KEY = "edgelin.kv_capacity"  # the graphs' entry a static-cache export carries

"""The vocabulary of export choices, declared once: the CLI's choices, the device profiles' checks, the manifest's
fields and each target's subsets of it (what a target writes, it says itself: edgelin.export.base.Target). A leaf
module: the registry, the device profiles and the Target base all import it, and it imports nothing."""

PRECISIONS = ("fp32", "fp16", "bf16")  # graph compute precision (--precision); bf16: the coreai target's
# weight-only quantisation (--quantize; fp16: float16 weight storage, float32 arithmetic); the state and recurrence
# stay float
QUANTIZE = ("int8", "int4", "fp16")
STATE_DTYPES = ("float32", "float16")  # the recurrent state's dtype at the graphs' I/O

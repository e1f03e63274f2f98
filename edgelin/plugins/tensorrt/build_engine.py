"""Build the TensorRT engines of an edgelin export (written by `edgelin export --target tensorrt`).

Standalone: needs only the `tensorrt` Python package (10.3+) and an NVIDIA GPU. Two copies of this
file run it: edgelin's installed module, which `edgelin build` runs with the engine spec it read and
checked from the folder's tensorrt/engines.json (passed on stdin, `--spec -`); and the copy export
writes into tensorrt/build_engine.py, with the spec filled in below, for building by hand. edgelin never
runs the folder's copy. By hand, from the export folder (or pass --folder):

    python tensorrt/build_engine.py --plugin tensorrt/libedgelin_trt_plugin_trt10.so [--fp16]
    python -m edgelin.plugins.tensorrt.build_engine --spec tensorrt/engines.json --plugin ...

The spec (engines.json's form: inplace, strongly_typed, graphs) holds each graph's optimisation profiles,
narrowest first: the edgelin TensorRT runner picks the first that holds a call's shapes. fp32 unless
--fp16; an fp16 export is built strongly typed (the graph's own fp16/fp32 types, no --fp16 needed). With
inplace (export --trt-inplace) the step's plugin nodes alias their state input and output, a TensorRT
preview feature (ALIASED_PLUGIN_IO_10_03) this script turns on. The ONNX files read their weights from
weights.bin beside them (one file for both graphs), so keep the export folder together. Writes
step.engine and prefill.engine beside the ONNX files (temp file, then rename).
"""

import argparse
import json
import os
import sys

# The folder's copy: the spec, filled in by export. edgelin's own module is given --spec instead.
GRAPHS = {}  # filled in by edgelin export
INPLACE = False  # filled in by edgelin export
# fp16 exports: the ONNX types decide each tensor's precision (fp16 matmuls and plugin q/k/v, fp32 state,
# gates and logits), so the network is built strongly typed rather than letting --fp16 pick per layer.
STRONGLY_TYPED = False  # filled in by edgelin export


def build(folder: str, graph: str, spec: dict, plugin: str, fp16: bool, inplace: bool = INPLACE,
          strongly_typed: bool = STRONGLY_TYPED) -> str:
    import tensorrt as trt

    logger = trt.Logger(trt.Logger.WARNING)
    trt.init_libnvinfer_plugins(logger, "")
    builder = trt.Builder(logger)
    builder.get_plugin_registry().load_library(plugin)  # the EdgelinStep creator
    # explicit batch is the only mode in TensorRT 10; strongly typed for fp16 exports (see STRONGLY_TYPED)
    network = builder.create_network(
        1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED) if strongly_typed else 0)
    parser = trt.OnnxParser(network, logger)
    # The graphs keep their weights in one file beside them (ONNX external data, shared by step and prefill);
    # the parser reads it relative to the .onnx file, which is why it parses from the path, not from bytes.
    weights = spec.get("weights")
    if weights and not os.path.isfile(os.path.join(folder, weights)):
        raise SystemExit(f"error: {weights} is missing from {os.path.abspath(folder)}: {spec['file']} reads its "
                         "weights from it; copy the whole export folder (or pass --folder with it)")
    if not parser.parse_from_file(os.path.join(folder, spec["file"])):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise SystemExit(f"error: parsing {spec['file']} failed: {errors}")
    config = builder.create_builder_config()
    for shapes in spec["profiles"]:
        profile = builder.create_optimization_profile()
        for name, (lo, opt, hi) in shapes.items():
            profile.set_shape(name, lo, opt, hi)
        config.add_optimization_profile(profile)
    if fp16 and not strongly_typed:  # a strongly typed network takes no precision flags
        config.set_flag(trt.BuilderFlag.FP16)
    if inplace and spec.get("aliased"):  # the plugin's getAliasedInput is read only with this on
        feature = getattr(trt.PreviewFeature, "ALIASED_PLUGIN_IO_10_03", None)
        if feature is None:
            raise SystemExit("error: this TensorRT has no ALIASED_PLUGIN_IO_10_03 preview feature (it needs 10.3+); "
                             "export again without --trt-inplace")
        config.set_preview_feature(feature, True)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise SystemExit(f"error: TensorRT could not build {spec['file']} (see the log above)")
    target = os.path.join(folder, spec.get("engine", f"{graph}.engine"))
    staged = target + ".tmp"
    with open(staged, "wb") as f:
        f.write(serialized)
    os.replace(staged, target)  # never a partial engine
    return target


def read_spec(source: str) -> dict:
    """engines.json's form from a file, or from stdin for `-` (what `edgelin build` passes, already checked)."""
    try:
        if source == "-":
            spec = json.load(sys.stdin)
        else:
            with open(source, encoding="utf-8") as f:
                spec = json.load(f)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"error: cannot read the engine spec {source}: {exc}")
    if not isinstance(spec, dict) or not isinstance(spec.get("graphs"), dict):
        raise SystemExit(f"error: the engine spec {source} has no graphs (it is a tensorrt/engines.json)")
    return spec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plugin", required=True, help="the edgelin plugin library (edgelin build builds it)")
    parser.add_argument("--folder", default=".", help="the export folder (default: the current folder)")
    parser.add_argument("--spec", help="an engines.json to build (- reads it from stdin); default: the spec "
                        "export filled into this file")
    parser.add_argument("--fp16", action="store_true", help="allow fp16 kernels")
    parser.add_argument("--graphs", nargs="*", help="which graphs (default: all)")
    parser.add_argument("--no-inplace", action="store_true", help="build the step without state aliasing even "
                        "though the export asked for it (the plugin then writes its state to a separate buffer)")
    args = parser.parse_args()
    spec = read_spec(args.spec) if args.spec else {"graphs": GRAPHS, "inplace": INPLACE,
                                                   "strongly_typed": STRONGLY_TYPED}
    graphs = spec["graphs"]
    if not graphs:
        sys.exit("error: no graphs to build: pass --spec with the export's tensorrt/engines.json")
    unknown = [g for g in args.graphs or () if g not in graphs]
    if unknown:
        sys.exit(f"error: no graph {', '.join(unknown)} in the spec (it has {', '.join(graphs)})")
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        sys.exit("error: the tensorrt Python package is not installed: pip install tensorrt (or use JetPack 6)")
    inplace = bool(spec.get("inplace")) and not args.no_inplace
    for graph in args.graphs or list(graphs):
        print(build(args.folder, graph, graphs[graph], os.path.abspath(args.plugin), args.fp16, inplace,
                    bool(spec.get("strongly_typed"))))


if __name__ == "__main__":
    main()

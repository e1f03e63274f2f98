"""Build the TensorRT engines of this edgelin export (written by `edgelin export --target tensorrt`).

Standalone: needs only the `tensorrt` Python package (10.3+) and numpy, and an NVIDIA GPU. Run from
the export folder (or pass --folder):

    python tensorrt/build_engine.py --plugin tensorrt/libedgelin_trt_plugin_trt10.so [--fp16]

The optimisation profiles below (tensorrt/engines.json holds the same), narrowest first: the edgelin
TensorRT runner picks the first that holds a call's shapes. fp32 unless --fp16; an fp16 export is built
strongly typed (STRONGLY_TYPED: the graph's own fp16/fp32 types, no --fp16 needed). With INPLACE (export
--trt-inplace) the step's plugin nodes alias their state input and output, a TensorRT preview feature
(ALIASED_PLUGIN_IO_10_03) this script turns on. The ONNX files read their weights from weights.bin
beside them (one file for both graphs), so keep the export folder together. Writes step.engine and
prefill.engine beside the ONNX files (temp file, then rename).
"""

import argparse
import os
import sys

GRAPHS = {}  # filled in by edgelin export
INPLACE = False  # filled in by edgelin export
# fp16 exports: the ONNX types decide each tensor's precision (fp16 matmuls and plugin q/k/v, fp32 state,
# gates and logits), so the network is built strongly typed rather than letting --fp16 pick per layer.
STRONGLY_TYPED = False  # filled in by edgelin export


def build(folder: str, graph: str, spec: dict, plugin: str, fp16: bool, inplace: bool = INPLACE) -> str:
    import tensorrt as trt

    logger = trt.Logger(trt.Logger.WARNING)
    trt.init_libnvinfer_plugins(logger, "")
    builder = trt.Builder(logger)
    builder.get_plugin_registry().load_library(plugin)  # the EdgelinStep creator
    # explicit batch is the only mode in TensorRT 10; strongly typed for fp16 exports (see STRONGLY_TYPED)
    network = builder.create_network(
        1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED) if STRONGLY_TYPED else 0)
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
    if fp16 and not STRONGLY_TYPED:  # a strongly typed network takes no precision flags
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plugin", required=True, help="the edgelin plugin library (edgelin build builds it)")
    parser.add_argument("--folder", default=".", help="the export folder (default: the current folder)")
    parser.add_argument("--fp16", action="store_true", help="allow fp16 kernels")
    parser.add_argument("--graphs", nargs="*", default=list(GRAPHS), help="which graphs (default: all)")
    parser.add_argument("--no-inplace", action="store_true", help="build the step without state aliasing even "
                        "though the export asked for it (the plugin then writes its state to a separate buffer)")
    args = parser.parse_args()
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        sys.exit("error: the tensorrt Python package is not installed: pip install tensorrt (or use JetPack 6)")
    for graph in args.graphs:
        print(build(args.folder, graph, GRAPHS[graph], os.path.abspath(args.plugin), args.fp16,
                    INPLACE and not args.no_inplace))


if __name__ == "__main__":
    main()

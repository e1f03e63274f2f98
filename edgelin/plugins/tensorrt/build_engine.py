"""Build the TensorRT engines of this edgelin export (written by `edgelin export --target tensorrt`).

Standalone: needs only the `tensorrt` Python package (10.3+) and numpy, and an NVIDIA GPU. Run from
the export folder (or pass --folder):

    python tensorrt/build_engine.py --plugin tensorrt/libedgelin_trt_plugin_trt10.so [--fp16]

One optimisation profile per graph, min/opt/max shapes as below (batch, prompt length); fp32 unless
--fp16. Writes step.engine and prefill.engine beside the ONNX files (temp file, then rename).
"""

import argparse
import os
import sys

GRAPHS = {}  # filled in by edgelin export


def build(folder: str, graph: str, spec: dict, plugin: str, fp16: bool) -> str:
    import tensorrt as trt

    logger = trt.Logger(trt.Logger.WARNING)
    trt.init_libnvinfer_plugins(logger, "")
    builder = trt.Builder(logger)
    builder.get_plugin_registry().load_library(plugin)  # the EdgelinStep creator
    network = builder.create_network(0)  # explicit batch is the only mode in TensorRT 10
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(os.path.join(folder, spec["file"])):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise SystemExit(f"error: parsing {spec['file']} failed: {errors}")
    config = builder.create_builder_config()
    profile = builder.create_optimization_profile()
    for name, (lo, opt, hi) in spec["shapes"].items():
        profile.set_shape(name, lo, opt, hi)
    config.add_optimization_profile(profile)
    if fp16:
        config.set_flag(trt.BuilderFlag.FP16)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise SystemExit(f"error: TensorRT could not build {spec['file']} (see the log above)")
    target = os.path.join(folder, f"{graph}.engine")
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
    args = parser.parse_args()
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        sys.exit("error: the tensorrt Python package is not installed: pip install tensorrt (or use JetPack 6)")
    for graph in args.graphs:
        print(build(args.folder, graph, GRAPHS[graph], os.path.abspath(args.plugin), args.fp16))


if __name__ == "__main__":
    main()

"""`optimum-cli export edgelin`: optimum's argument conventions mapped onto `edgelin export`.

optimum-cli (optimum 2.3) imports every `register_*.py` module of the `optimum.commands.register` namespace
package and registers its REGISTER_COMMANDS. edgelin's distribution ships this file into that namespace (no
`__init__.py` anywhere under optimum/: optimum, optimum.commands and optimum.commands.register are PEP 420
namespace packages). The module stays light: edgelin is imported only when the command runs, and the export
is `edgelin export` itself (the same typer command, its checks, messages and exit codes), not a second path.

    optimum-cli export edgelin --model CKPT OUT_DIR [--task text-generation-with-past] [--device cpu|cuda]
                               [--dtype fp32|fp16] [--target TARGET] [--device-profile NAME]
                               [--serve triton] [--force]
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from optimum.commands.base import BaseOptimumCLICommand, CommandInfo
from optimum.commands.export.base import ExportCommand

if TYPE_CHECKING:
    from argparse import ArgumentParser

TASK = "text-generation-with-past"  # a stateful step graph: optimum's name for a decoder with its cache
DEVICE_PROFILES = {"cpu": "desktop-cpu", "cuda": "desktop-gpu"}  # --device -> edgelin's device profile
DTYPES = {"fp32": "fp32", "fp16": "fp16", "float32": "fp32", "float16": "fp16"}  # --dtype -> --precision


# `edgelin export`'s option names in its error and warning lines -> this command's (edgelin's --out is the
# positional `output` here, --precision is --dtype, an edgelin --device NAME is --device-profile NAME).
SPELLING = ((re.compile(r"optimum-cli export edgelin export\b"), "optimum-cli export edgelin"),  # usage errors
            (re.compile(r"`edgelin export`"), "`optimum-cli export edgelin`"),
            (re.compile(r"(?<![^\s`(])--out\b"), "output"),  # an option in prose, not inside a path
            (re.compile(r"(?<![^\s`(])--precision\b"), "--dtype"),
            (re.compile(r"(?<![^\s`(])--device(?![-\w])"), "--device-profile"))


def optimum_spelling(text: str) -> str:
    """An `edgelin export` error or warning line in optimum-cli's terms."""
    for pattern, replacement in SPELLING:
        text = pattern.sub(replacement, text)
    return text


def edgelin_argv(model: str, output: str, task: str = TASK, device: str | None = None, dtype: str | None = None,
                 target: str | None = None, device_profile: str | None = None, serve: str | None = None,
                 force: bool = False) -> list[str]:
    """The `edgelin export` arguments for optimum-cli's; a value edgelin cannot map is an EdgelinError."""
    from edgelin.errors import EdgelinError
    from edgelin.export.targets import default_target, target_names

    if task != TASK:
        raise EdgelinError(f"--task {task}", f"edgelin exports one task, {TASK} (a step graph whose recurrent "
                           "state is an input and an output, and a chunked prefill graph)",
                           f"pass --task {TASK}, or leave --task out")
    if device is not None and device not in DEVICE_PROFILES:
        raise EdgelinError(f"--device {device}", "edgelin maps cpu to the desktop-cpu profile and cuda to the "
                           "desktop-gpu profile", "pass --device cpu or --device cuda, or --device-profile NAME "
                           "(`edgelin devices` lists them)")
    if device is not None and device_profile is not None and DEVICE_PROFILES[device] != device_profile:
        raise EdgelinError(f"--device {device} with --device-profile {device_profile}",
                           f"--device {device} means the {DEVICE_PROFILES[device]} profile",
                           "pass one of the two")
    if dtype is not None and dtype not in DTYPES:
        raise EdgelinError(f"--dtype {dtype}", "edgelin exports fp32 or fp16 graphs (the recurrence and the "
                           "state stay float32); for int8/int4 weights use `edgelin export --quantize`",
                           "pass --dtype fp32 or --dtype fp16")
    target = target or default_target()
    if target not in target_names():  # checked here: edgelin's own message would name `... edgelin export --help`
        raise EdgelinError(f"--target {target}", f"optimum-cli's edgelin export writes {', '.join(target_names())}",
                           "pass one of those (`optimum-cli export edgelin --help`)")
    argv = ["export", model, "--out", output, "--target", target]
    profile = device_profile or (DEVICE_PROFILES[device] if device is not None else None)
    argv += ["--device", profile] if profile else []
    argv += ["--precision", DTYPES[dtype]] if dtype else []
    argv += ["--serve", serve] if serve else []
    argv += ["--force"] if force else []
    return argv


class EdgelinExportCommand(BaseOptimumCLICommand):
    COMMAND = CommandInfo(name="edgelin", help="Export a linear-attention checkpoint with edgelin (stateful step + "
                                               "chunked prefill graphs for ONNX Runtime, TensorRT, Core ML).")

    @staticmethod
    def parse_args(parser: "ArgumentParser") -> None:
        parser.add_argument("-m", "--model", required=True,
                            help="Checkpoint folder (config.json + safetensors) or an edgelin recipe folder.")
        parser.add_argument("output", help="Output folder (must not exist unless --force).")
        parser.add_argument("--task", default=TASK, help=f"The one task edgelin exports: {TASK} (default).")
        parser.add_argument("--device", default=None,
                            help="cpu -> the desktop-cpu device profile, cuda -> desktop-gpu (fp16 graphs unless "
                                 "--dtype fp32). Default: no profile, as `edgelin export`.")
        parser.add_argument("--dtype", default=None, help="fp32 or fp16: the graphs' compute precision "
                                                          "(edgelin export --precision).")
        parser.add_argument("--target", default=None, help="An edgelin target, as `edgelin export TARGET` names it "
                                                             "(`edgelin export --help` lists them). Default: edgelin's.")
        parser.add_argument("--device-profile", default=None,
                            help="An edgelin device profile by name (`edgelin devices`); a different --device is refused.")
        parser.add_argument("--serve", default=None, help="triton: also write a Triton Inference Server model "
                                                          "repository under OUTPUT/triton/.")
        parser.add_argument("--force", action="store_true", help="Replace an export edgelin wrote at OUTPUT.")

    def run(self) -> None:
        from edgelin.cli import app
        from edgelin.errors import EdgelinError
        from edgelin.output import Output, spelled

        a = self.args
        try:
            argv = edgelin_argv(a.model, a.output, a.task, a.device, a.dtype, a.target, a.device_profile, a.serve,
                                a.force)
        except EdgelinError as exc:
            Output().error(exc.line())
            raise SystemExit(2) from None
        with spelled(optimum_spelling):  # edgelin's lines name this command's options, not `edgelin export`'s
            app(args=argv, prog_name="optimum-cli export edgelin")  # exits with edgelin's code


REGISTER_COMMANDS = [(EdgelinExportCommand, ExportCommand)]

"""The Core ML target: .mlpackage functions converted with coremltools, their contract check
(edgelin.export.coreml.check) and runner (edgelin.export.coreml.runner, torch-free). Light on purpose:
the registry reads TARGET below without importing torch or coremltools."""

TARGET = "edgelin.export.coreml.target:CoremlTarget"

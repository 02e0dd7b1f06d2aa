from onnx_prep.cli.app import entry

entry()

from onnx_prep.cli.app import main

main()

from onnx_kvcache._entry import main

main()

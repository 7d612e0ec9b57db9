from onnx_kvcache._entry import main

if __name__ == "__main__":
    main()

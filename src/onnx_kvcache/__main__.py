from onnx_kvcache.cli import main

raise SystemExit(main())

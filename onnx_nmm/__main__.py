import sys

from onnx_nmm.cli import main

sys.exit(main())

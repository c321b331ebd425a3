"""``python -m binbatch_sidecar.emulator [flags]``: the engine emulator alone."""

import sys

from .cli import main

sys.exit(main())

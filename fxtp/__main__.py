"""``python -m fxtp``: see :mod:`fxtp.cli`."""
import sys

from .cli import main

sys.exit(main())

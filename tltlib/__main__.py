"""Entry point of ``python -m tltlib`` (see :mod:`tltlib.cli`)."""
import sys

from .cli import main

sys.exit(main())

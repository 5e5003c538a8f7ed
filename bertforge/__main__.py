"""``python -m bertforge`` (and ``torchrun -m bertforge``) is the ``bertforge`` command."""
import sys

from .cli import main

sys.exit(main())

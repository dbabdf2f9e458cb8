"""``python -m jaxcomp.train``: see ``jaxcomp.train.cli``."""

import sys

from jaxcomp.train import cli

sys.exit(cli.main())

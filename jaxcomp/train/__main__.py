"""``python -m jaxcomp.train``: see ``jaxcomp.train.job``."""

import sys

from jaxcomp.train import job

sys.exit(job.main())

"""``python -m jaxformer``: the ``jaxformer`` command."""

import sys

from jaxformer.cli.main import main

sys.exit(main())

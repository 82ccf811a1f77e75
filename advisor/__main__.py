"""``python -m advisor --config FILE.json``: run the advisor service as its own process."""

import sys

from advisor.embedded.service import main

sys.exit(main())

"""``python -m hf_asymkv.cli``: the ``hf-asymkv`` command without the console script (e.g. from a source checkout)."""

import sys

from .app import main

sys.exit(main())

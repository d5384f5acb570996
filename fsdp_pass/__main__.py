"""``python -m fsdp_pass``: see :mod:`fsdp_pass.cli`."""

from .cli import main

raise SystemExit(main())

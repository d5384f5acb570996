"""``python -m fsdp_pass``: see :mod:`fsdp_pass.plan.cli`."""

from .plan.cli import main

raise SystemExit(main())

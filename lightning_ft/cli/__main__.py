"""``python -m lightning_ft.cli``: the same as the ``lightning-ft`` console script."""

from lightning_ft.cli import main

raise SystemExit(main())

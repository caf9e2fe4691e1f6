"""``python -m tracetrain_cli``: the same as the ``tracetrain`` command."""

from tracetrain_cli._main import main

raise SystemExit(main())

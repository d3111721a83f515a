"""``python -m prefixcache`` is the ``prefixcache`` command."""

from prefixcache.cli import main

raise SystemExit(main())

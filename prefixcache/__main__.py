"""``python -m prefixcache`` is the ``prefixcache`` command."""

from prefixcache.cli import main

if __name__ == "__main__":  # not when an engine process (spawned) imports this main module again
    raise SystemExit(main())

"""``python -m prefixcache`` is the ``prefixcache`` command."""

from prefixcache.cli import main

if __name__ == "__main__":  # not when something imports this module (multiprocessing's spawn, runpy)
    raise SystemExit(main())

"""``python -m refcache.cli``: the ``refcache`` command."""

from refcache.cli import main

main()

"""``python -m bench`` runs the spawn benchmark (``python -m bench.spawn --help``)."""

from bench.spawn import main

if __name__ == "__main__":
    main()

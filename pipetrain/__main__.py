"""``python -m pipetrain``: the same as the ``pipetrain`` command."""

from pipetrain.app.cli import main

if __name__ == "__main__":  # spawned worker processes import this module too
    raise SystemExit(main())

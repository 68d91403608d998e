"""``python -m pipetrain``: the same as the ``pipetrain`` command."""

from pipetrain.app.cli import entry

if __name__ == "__main__":  # spawned worker processes import this module too
    entry()

"""``python -m lightning_eagle.commands fit --config …``: the ``lightning-eagle`` command (e.g. under ``torchrun``)."""

from lightning_eagle.commands.cli import main

if __name__ == "__main__":
    main()

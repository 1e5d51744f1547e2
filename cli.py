"""Entry point: ``python cli.py fit --config configs/quickstart.yaml`` (same as the ``lightning-eagle`` script)."""

from lightning_eagle.commands.cli import main

if __name__ == "__main__":
    main()

"""Moved: the K3 smoke run is ``python -m lightning_eagle.commands.smoke_target``."""

if __name__ == "__main__":
    print("moved: use python -m lightning_eagle.commands.smoke_target")
    raise SystemExit(2)

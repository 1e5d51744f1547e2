"""Moved: the tiny target's pretraining is ``python -m lightning_eagle.commands.pretrain_target`` (the quickstart
target's path, ``QUICKSTART_TARGET``, is in :mod:`lightning_eagle.k3.loader`)."""

if __name__ == "__main__":
    print("moved: use python -m lightning_eagle.commands.pretrain_target")
    raise SystemExit(2)

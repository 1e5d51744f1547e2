"""Moved: the KDA whole-model check is ``python -m lightning_eagle.commands.check_kda`` (the record it writes is
:mod:`lightning_eagle.k3.kda_records`, the comparison :mod:`lightning_eagle.k3.kda_compare`)."""

if __name__ == "__main__":
    print("moved: use python -m lightning_eagle.commands.check_kda")
    raise SystemExit(2)

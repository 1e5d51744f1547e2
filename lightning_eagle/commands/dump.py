"""``lightning-eagle dump --config … [--out DIR]``: the config's target, taps and data run once through Lightning
``predict`` with a shard writer, so drafts can then train from the features without the target."""

from __future__ import annotations

import sys
from pathlib import Path

from lightning_eagle.commands.arguments import CommandParser
from lightning_eagle.commands.config_cli import chat_data_cli
from lightning_eagle.dtypes import DTYPES
from lightning_eagle.features import format as fmt
from lightning_eagle.features.dump import dump_features


def main(words: list[str] | None = None, from_sys_argv: bool = False) -> None:
    parser = CommandParser(
        prog="lightning-eagle dump",
        description="Run the frozen target once over the config's data and store its tapped features "
        "(then train with model.target.source: features, e.g. configs/quickstart_offline.yaml). Other options "
        "(--config, --trainer.*, --model.*, --data.*) are read as for fit; --model.target.token_chunk runs the "
        "target forward in token segments here too.",
    )
    parser.add_argument("--out", default=None, help="features folder (default: <trainer.default_root_dir>/features)")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES), help="storage dtype of the states")
    parser.add_argument("--hidden-states", default="prenorm", choices=fmt.HIDDEN_KINDS,
                        help="final hidden before (default) or after the final norm")  # fmt: skip
    parser.add_argument("--shard-rows", type=int, default=256,
                        help="at most this many rows per shard file (a shard is collected in host memory)")  # fmt: skip
    parser.add_argument("--shard-tokens", type=int, default=None,
                        help="at most this many tokens per shard file (default: no token budget); bounds the host "
                        "memory of long rows: bytes/token x this, e.g. 57 KB x 262144 = 15 GB on K3")  # fmt: skip
    args, rest = parser.parse_known_args(sys.argv[1:] if words is None else words)
    cli = chat_data_cli(rest, from_sys_argv or words is None, command="dump")
    trainer = cli.trainer
    out = Path(args.out) if args.out else Path(trainer.default_root_dir) / "features"
    # the target forward runs as the run's own: model.target.token_chunk (memory linear in T) applies to the dump too
    dump_features(cli.model.target_spec, cli.datamodule, out, trainer, dtype=args.dtype,
                  hidden_states=args.hidden_states, shard_rows=args.shard_rows, shard_tokens=args.shard_tokens,
                  target_token_chunk=cli.model.target_settings.token_chunk)  # fmt: skip


if __name__ == "__main__":
    main()

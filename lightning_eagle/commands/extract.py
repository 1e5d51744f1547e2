"""``lightning-eagle extract --config … (--vllm-model PATH | --vllm-url URL) [--out DIR]``: the config's chats
rendered and masked by its data module, their token ids sent to a vLLM engine (``extract_hidden_states``) and its
captures stored as our features, so either family trains from them (``data: HiddenStateDataModule``, offline, or
``data.streaming: true`` while this still runs). See :mod:`lightning_eagle.features.extract`."""

from __future__ import annotations

import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from lightning_eagle.commands.arguments import CommandParser
from lightning_eagle.commands.config_cli import chat_data_cli
from lightning_eagle.dtypes import DTYPES
from lightning_eagle.features.engine_client import FeatureEngine, HttpEngine, WorkerEngine
from lightning_eagle.features.engine_ids import EngineCapture, engine_capture, serve_command
from lightning_eagle.features.extract import Producer


def parser() -> CommandParser:
    p = CommandParser(
        prog="lightning-eagle extract",
        description="Extract the config's target features with a vLLM engine (an offline engine this command starts, "
        "or a running `vllm serve`) into a features folder. Other options (--config, --model.*, --data.*) are read "
        "as for fit.",
    )
    engine = p.add_mutually_exclusive_group()
    engine.add_argument("--vllm-model", default=None,
                        help="start an offline vLLM engine on this folder (default: model.target.path)")  # fmt: skip
    engine.add_argument("--vllm-url", default=None, help="a running `vllm serve` (its files readable here)")
    p.add_argument("--out", default=None, help="features folder (default: <trainer.default_root_dir>/features)")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES), help="storage dtype of the states")
    p.add_argument("--shard-rows", type=int, default=256, help="at most this many rows per shard file")
    p.add_argument("--shard-tokens", type=int, default=None, help="at most this many tokens per shard file")
    p.add_argument("--concurrency", type=int, default=8, help="rows in flight at the engine")
    p.add_argument("--max-ahead", type=int, default=None,
                   help="streaming: write at most this many training shards ahead of what the fit's saved "
                   "checkpoints have passed (bounds the disk)")  # fmt: skip
    p.add_argument("--final-id-is-output", action="store_true",
                   help="K3, stream prefix: the engine has vLLM PR #50815 (id L is the model's output)")  # fmt: skip
    p.add_argument("--served-env", action="append", default=[], metavar="NAME=VALUE",
                   help="--vllm-url: a setting the server runs with that it does not report")  # fmt: skip
    p.add_argument("--vllm-python", default=None, help="the engine's interpreter (default: this one)")
    p.add_argument("--vllm-dtype", default="bfloat16", help="the engine's model dtype")
    p.add_argument("--vllm-max-model-len", type=int, default=None, help="default: data.max_length")
    p.add_argument("--vllm-cpu", action="store_true",
                   help="vLLM's CPU build: the connector subclass without pinned memory")  # fmt: skip
    p.add_argument("--vllm-engine-args", default="{}", help="more vllm.LLM keyword arguments, as JSON")
    p.add_argument("--vllm-storage", default=None,
                   help="the engine's file folder (offline: a temp dir if unset; the serve line's)")  # fmt: skip
    p.add_argument("--print-serve-line", action="store_true", help="print the `vllm serve` line for this run and stop")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def build(words: list[str], from_sys_argv: bool = False) -> tuple[Producer, Callable, bool] | None:
    """The producer of ``words`` (everything checked, no engine started), its engine factory and whether to show a
    progress bar; None when ``--print-serve-line`` printed the line instead."""
    args, rest = parser().parse_known_args(words)
    cli = chat_data_cli(rest, from_sys_argv, command="extract")
    spec, data = cli.model.target_spec, cli.datamodule
    if args.print_serve_line:
        capture = engine_capture(spec, args.final_id_is_output)
        storage = args.vllm_storage or "/shared/hidden_states"
        print(serve_command(capture, str(spec.path), storage, cpu_connector=args.vllm_cpu))
        return None
    served = dict(item.split("=", 1) for item in args.served_env if "=" in item)
    bad = [item for item in args.served_env if "=" not in item]
    if bad:
        raise ValueError(f"--served-env takes NAME=VALUE, got {bad}")
    try:
        engine_args = json.loads(args.vllm_engine_args)
    except json.JSONDecodeError as err:
        raise ValueError(f"--vllm-engine-args is not JSON: {err}") from None
    out = Path(args.out) if args.out else Path(cli.trainer.default_root_dir) / "features"
    producer = Producer(spec, data, out, dtype=args.dtype, shard_rows=args.shard_rows, shard_tokens=args.shard_tokens,
                        concurrency=args.concurrency, max_ahead=args.max_ahead, engine_dtype=args.vllm_dtype,
                        final_id_is_output=args.final_id_is_output,
                        log=lambda line: print(line, file=sys.stderr, flush=True))  # fmt: skip

    def open_engine(capture: EngineCapture) -> FeatureEngine:
        if args.vllm_url:
            return HttpEngine(args.vllm_url, concurrency=args.concurrency, env=served)
        storage = args.vllm_storage or tempfile.mkdtemp(prefix="lightning-eagle-extract-")
        config = {
            "model": str(Path(args.vllm_model or spec.path).resolve()), "aux_ids": list(capture.ids),
            "storage": storage, "dtype": args.vllm_dtype, "env": capture.env, "cpu_connector": args.vllm_cpu,
            "max_model_len": args.vllm_max_model_len or int(data.max_length) + 1, "engine_args": engine_args,
        }  # fmt: skip
        return WorkerEngine(config, log=out.parent / f"{out.name}.engine.log", python=args.vllm_python)

    return producer, open_engine, not args.no_progress


def main(words: list[str] | None = None, from_sys_argv: bool = False) -> None:
    built = build(sys.argv[1:] if words is None else words, from_sys_argv or words is None)
    if built is not None:
        producer, open_engine, progress_bar = built
        producer.run(open_engine, progress_bar=progress_bar)


if __name__ == "__main__":
    main()

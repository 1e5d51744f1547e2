"""Producer throughput (``cli.py extract``) beside ``cli.py dump``: the same K3 target, the same rows, one run.

    python benchmarks/engine_features.py                      # CPU: the bundled tiny K3 (k3-tiny-chat), fp32
    python benchmarks/engine_features.py --vllm-python PY     # + vLLM (a CUDA build) serving the same checkpoint

Rows (tokens/s of the writing phase, the engine's start excluded; the time with it beside; ratio = row / dump):

* ``dump`` — our target's batched forward (``dump_features``, what ``cli.py dump`` runs);
* ``extract, own target in-process`` — the producer over :class:`~lightning_eagle.features.own_engine.OwnTargetEngine`
  (the same K3 forward, one row at a time, written as vLLM's per-request files): the producer's own cost (a file per
  row written, read, checked and removed; shards written) on top of an unbatched forward;
* ``extract, own target over HTTP`` — the same engine behind a local server speaking ``vllm serve``'s endpoints, read
  by ``HttpEngine`` (``--vllm-url``): plus the request round trip and the connector-lock wait, ``--concurrency`` rows
  in flight;
* ``extract, vLLM offline`` (with ``--vllm-python``) — vLLM's ``extract_hidden_states`` in the extract worker, the
  real engine (bf16: what vLLM's K3 kernels take; the other rows are fp32).

vLLM's CPU build cannot run K3, so on a CPU machine the vLLM row is absent: the CPU rows measure the producer's
overhead, not an engine's speed.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import lightning.pytorch as pl
import torch

from lightning_eagle import ChatDataModule
from lightning_eagle.features import format as fmt
from lightning_eagle.features.dump import dump_features
from lightning_eagle.features.engine_client import HttpEngine, WorkerEngine
from lightning_eagle.features.engine_ids import engine_ids
from lightning_eagle.features.extract import Producer
from lightning_eagle.features.own_engine import OwnTargetEngine
from lightning_eagle.k3.loader import QUICKSTART_TARGET
from lightning_eagle.k3.model import KimiK3ForCausalLM
from lightning_eagle.k3.target_spec import TargetSpec

TAPS = (1, 3, 5)


def _data(rows: int, max_length: int, folder: Path) -> ChatDataModule:
    from lightning_eagle.data.synthetic_corpus import bundled_sample_path

    chats = folder / "chats.jsonl"
    chats.write_text("".join(bundled_sample_path().read_text().splitlines(keepends=True)[:rows]))
    return ChatDataModule(train_files=[str(chats)], tokenizer="synthetic", max_length=max_length, batch_size=8,
                          thinking_effort=None, use_cache=False, val_fraction=0.05)  # fmt: skip


def _own_server(engine: OwnTargetEngine) -> ThreadingHTTPServer:
    # the forwards run on one long-lived thread, as an engine's do: a thread per request would start a new OpenMP
    # team for every forward and measure that instead
    forward = ThreadPoolExecutor(max_workers=1)

    class Handler(BaseHTTPRequestHandler):
        disable_nagle_algorithm = True  # headers and body go out in two writes: no 40 ms delayed-ACK stall

        def log_message(self, *args) -> None:
            pass

        def _answer(self, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/version":
                return self._answer({"version": engine.version})
            if self.path == "/v1/models":
                return self._answer({"data": [{"id": "k3-tiny"}]})
            return self._answer({"vllm_env": {k: v == "1" for k, v in engine.env.items()}})  # /server_info

        def do_POST(self) -> None:
            prompt = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["prompt"]
            path = forward.submit(engine.write, prompt).result()
            self._answer({"kv_transfer_params": {"hidden_states_path": str(path)}})

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _extract(spec, data, out: Path, open_engine, concurrency: int) -> dict:
    producer = Producer(spec, data, out, dtype="float32", shard_rows=64, concurrency=concurrency, log=lambda line: None)
    started = time.perf_counter()
    producer.run(open_engine, progress_bar=False)
    total, written = time.perf_counter() - started, producer.written
    return {"tokens": written["tokens"], "write_s": written["seconds"], "total_s": total,
            "tokens_per_s": written["tokens"] / written["seconds"]}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=96, help="chats of the bundled corpus")
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the forwards (every row)")
    parser.add_argument("--vllm-python", default=None, help="a Python with vLLM's CUDA build (adds the vLLM row)")
    parser.add_argument("--out", default=None, help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    torch.set_num_threads(
        args.threads
    )  # the same for every row; 1 keeps idle OpenMP workers off the cores the producer's I/O threads need
    spec = TargetSpec.from_checkpoint("quickstart", aux_layer_ids=TAPS, aux_stream="mixed", dtype="float32")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        trainer = pl.Trainer(accelerator="auto", devices=1, logger=False, enable_progress_bar=False,
                             enable_model_summary=False, default_root_dir=str(tmp))  # fmt: skip
        data = _data(args.rows, args.max_length, tmp)
        started = time.perf_counter()
        dumped = dump_features(spec, data, tmp / "dump", trainer, dtype="float32", shard_rows=64)
        seconds = time.perf_counter() - started
        tokens = fmt.read_json(dumped / fmt.MANIFEST_NAME)["tokens"]
        rows.append({"path": "dump", "tokens": tokens, "write_s": seconds, "total_s": seconds,
                     "tokens_per_s": tokens / seconds})  # fmt: skip
        device = "cuda" if torch.cuda.is_available() else "cpu"
        model = KimiK3ForCausalLM.from_pretrained("quickstart", dtype=torch.float32).to(device)

        def own(capture):
            return OwnTargetEngine(model, capture.ids, tmp / "own_files", stream="mixed")

        data = _data(args.rows, args.max_length, tmp)
        rows.append({"path": "extract, own target in-process",
                     **_extract(spec, data, tmp / "own", own, args.concurrency)})  # fmt: skip
        ids = engine_ids(TAPS, spec.num_layers)[0]
        server_engine = OwnTargetEngine(model, list(ids), tmp / "http_files", stream="mixed")
        server = _own_server(server_engine)
        url = f"http://127.0.0.1:{server.server_address[1]}"
        data = _data(args.rows, args.max_length, tmp)
        http = _extract(spec, data, tmp / "http", lambda c: HttpEngine(url, args.concurrency), args.concurrency)
        rows.append({"path": "extract, own target over HTTP", **http})
        server.shutdown()
        if args.vllm_python:

            def vllm(capture):
                config = {"model": str(QUICKSTART_TARGET.parent), "aux_ids": list(capture.ids),
                          "storage": str(tmp / "vllm_files"), "dtype": "bfloat16", "env": capture.env,
                          "max_model_len": args.max_length + 1, "cpu_connector": False,
                          "engine_args": {"enforce_eager": True}}  # fmt: skip
                return WorkerEngine(config, log=tmp / "vllm.log", python=args.vllm_python)

            data = _data(args.rows, args.max_length, tmp)
            rows.append({"path": "extract, vLLM offline (bf16)",
                         **_extract(spec, data, tmp / "vllm", vllm, args.concurrency)})  # fmt: skip
    base = rows[0]["tokens_per_s"]
    print(f"{args.rows} chats (max_length {args.max_length}), taps {list(TAPS)} + final, stream mixed, on {device}\n")
    print("| path | tokens | writing s | with engine start s | tokens/s | ratio to dump |\n|---|---|---|---|---|---|")
    for row in rows:
        row["ratio_to_dump"] = row["tokens_per_s"] / base
        print(f"| {row['path']} | {row['tokens']} | {row['write_s']:.2f} | {row['total_s']:.2f} | "
              f"{row['tokens_per_s']:.0f} | {row['ratio_to_dump']:.2f} |")  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

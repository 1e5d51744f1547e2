"""Chat-data tokenization: throughput and peak memory of read + normalize + render + tokenize + mask + cache.

    python benchmarks/data.py                      # 20k rows for throughput; 20k vs 200k rows for memory
    python benchmarks/data.py --rows 4000 --memory-rows 5000 50000   # quicker

Reports:

* rows/s and tokens/s of ``TokenizedChatDataset.build_or_load`` (a fresh cache: every row is read, normalized,
  rendered in K3 XTML, tokenized, masked and written) with 1 worker (in this process) and 2 spawned workers, on the
  synthetic corpus (OpenAI messages with tool calls and reasoning) and on the same chats as ShareGPT rows;
* peak RSS (``VmHWM``, reset after the imports) of a fresh process that tokenizes N rows, for two N ten times apart,
  and their ratio: rows are streamed in chunks and written to the cache as they complete, so the peak must not grow
  with N (the cache is memory-mapped in both runs, so the result itself is not counted).

Synthetic rows are written to a temporary folder first, ``generate_synthetic_corpus`` a batch at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from lightning_eagle.data import generate_synthetic_corpus, synthetic_k3_tokenizer  # noqa: E402
from lightning_eagle.data.dataset import EncodeOptions, TokenizedChatDataset  # noqa: E402
from lightning_eagle.data.loss_mask import KIMI_K3  # noqa: E402

BATCH = 5000
RENDER = {"thinking": True, "thinking_effort": None}


def options() -> EncodeOptions:
    return EncodeOptions(4096, dict(RENDER), KIMI_K3.name, dict(KIMI_K3.defaults), "raise")


def to_sharegpt(row: dict) -> dict | None:
    """The chat as a ShareGPT row (None for chats with tool calls, which plain ShareGPT turns cannot carry)."""
    turns = []
    for m in row["messages"]:
        if m.get("tool_calls") or m["role"] == "tool":
            return None
        turns.append({"from": {"user": "human", "assistant": "gpt"}.get(m["role"], m["role"]), "value": m["content"]})
    return {"id": row.get("id"), "conversations": turns}


def write_rows(path: Path, n: int, sharegpt: bool = False) -> Path:
    written, seed = 0, 0
    with open(path, "w") as f:
        while written < n:
            for row in generate_synthetic_corpus(BATCH, seed=seed):
                row = to_sharegpt(row) if sharegpt else row
                if row is None:
                    continue
                f.write(json.dumps(row) + "\n")
                written += 1
                if written == n:
                    break
            seed += 1
    return path


def throughput(path: Path, workers: int, cache: Path) -> tuple[float, float, int]:
    tok = synthetic_k3_tokenizer()
    start = time.perf_counter()
    data = TokenizedChatDataset.build_or_load([path], tok, KIMI_K3, options(), cache_dir=cache, workers=workers)
    seconds = time.perf_counter() - start
    return data.summary.rows_read / seconds, data.summary.tokens / seconds, data.summary.tokens


PEAK_SCRIPT = """
import json, resource, sys
from lightning_eagle.data import dataset as d, synthetic_k3_tokenizer
from lightning_eagle.data.loss_mask import KIMI_K3

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])

d.MMAP_MIN_BYTES = 0  # both runs map their result: only the pipeline is measured
tok = synthetic_k3_tokenizer()
options = d.EncodeOptions(4096, {"thinking": True, "thinking_effort": None}, "kimi_k3", dict(KIMI_K3.defaults))
before = status("VmRSS")
try:  # reset the peak (VmHWM) so the imports' transient peak is not counted (Linux >= 4.0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
except OSError:
    pass
data = d.TokenizedChatDataset.build_or_load([sys.argv[1]], tok, KIMI_K3, options, cache_dir=sys.argv[2],
                                            workers=int(sys.argv[3]))
children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
print(json.dumps({"before_kb": before, "peak_kb": status("VmHWM"), "children_kb": children,
                  "rows": data.summary.rows_read, "tokens": data.summary.tokens}))
"""


def peak_memory(path: Path, cache: Path, workers: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-c", PEAK_SCRIPT, str(path), str(cache), str(workers)],
        env=env, check=True, capture_output=True, text=True,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=20_000, help="rows for the throughput runs")
    parser.add_argument("--memory-rows", type=int, nargs=2, default=[20_000, 200_000], metavar=("SMALL", "LARGE"))
    parser.add_argument("--memory-workers", type=int, default=0, help="tokenize workers of the memory runs")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        print(f"throughput: {args.rows} rows, fresh cache each run, {os.cpu_count()} CPU cores")
        print(f"{'rows':<34}{'workers':>8}{'rows/s':>10}{'tokens/s':>12}{'tokens/row':>12}")
        for label, sharegpt in (("synthetic (OpenAI, tools+reasoning)", False), ("same chats as ShareGPT", True)):
            path = write_rows(tmp / f"rows_{int(sharegpt)}.jsonl", args.rows, sharegpt=sharegpt)
            for workers, name in ((1, "1"), (2, "2")):
                rows_s, tokens_s, tokens = throughput(path, workers, tmp / f"cache_{label[:4]}_{workers}")
                print(f"{label:<34}{name:>8}{rows_s:>10.0f}{tokens_s:>12.0f}{tokens / args.rows:>12.1f}")

        small, large = args.memory_rows
        print(f"\npeak RSS of a fresh process tokenizing N rows (workers={args.memory_workers}; cache memory-mapped)")
        results = {}
        for n in (small, large):
            path = write_rows(tmp / f"memory_{n}.jsonl", n)
            size = path.stat().st_size
            results[n] = r = peak_memory(path, tmp / f"cache_memory_{n}", args.memory_workers)
            print(
                f"N={n:>7}: input {size / 2**20:6.1f} MiB, {r['tokens']:>9} tokens, RSS after imports "
                f"{r['before_kb'] / 1024:6.1f} MiB, peak {r['peak_kb'] / 1024:6.1f} MiB "
                f"(+{(r['peak_kb'] - r['before_kb']) / 1024:5.1f} MiB while tokenizing)"
                + (f", workers' peak {r['children_kb'] / 1024:6.1f} MiB" if args.memory_workers > 1 else "")
            )
            path.unlink()
        ratio = results[large]["peak_kb"] / results[small]["peak_kb"]
        growth = (results[large]["peak_kb"] - results[large]["before_kb"]) / max(
            results[small]["peak_kb"] - results[small]["before_kb"], 1
        )
        print(f"peak ratio N={large} / N={small}: {ratio:.3f} (growth while tokenizing: {growth:.2f}x)")


if __name__ == "__main__":
    main()

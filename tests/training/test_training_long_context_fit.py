"""``cli.py fit`` on long rows: chats of 8K-16K tokens (generated here) at ``max_length`` 16384 on the bundled tiny
target, with every long-context mechanism on, in a fresh process whose peak RSS is reported and bounded.

The bound is what makes the test able to fail on memory: one ``[B,n,T,T]`` fp32 tensor of the tiny draft at
T = 16384 is 4.3 GB (``attention_backend: eager`` materialises several), a ``[T, N_d]`` fp32 teacher 21 MB per
step, while the whole long-context run peaked at 776 MB.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_eagle.data.long_corpus import rendered_length, write_long_corpus
from lightning_eagle.planning.cpu_probe import PROBE_ENV

REPO = Path(__file__).resolve().parents[2]
PEAK_RSS_BOUND = 3e9  # bytes; measured 762-776 MB alone (closing note of issue 21); eager: > 4.3 GB

LONG_CONTEXT_SETTINGS = [
    "--model.draft.attention_backend", "flash_lse",
    "--model.draft.activation_checkpointing", "true",
    "--model.objective.loss_backend", "chunked",
    "--model.draft.kv_cache", "latent",
    "--model.target.token_chunk", "2048",
]  # fmt: skip

_RUN = """
import json, resource, sys
from lightning_eagle.commands.cli import main
try:
    main(sys.argv[1:])
finally:
    print("RESULT " + json.dumps({"max_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


@pytest.mark.slow
def test_fit_on_16k_token_rows_with_bounded_memory(tmp_path):
    rows = write_long_corpus(tmp_path / "long.jsonl", 3, seed=0)
    chats = [json.loads(line) for line in rows.read_text().splitlines()]
    lengths = [rendered_length(chat["messages"], "synthetic", thinking=True, thinking_effort=None) for chat in chats]
    assert min(lengths) >= 8192 and max(lengths) <= 16384, lengths
    args = [
        "fit", "--config", str(REPO / "configs" / "quickstart.yaml"),
        "--data.train_files", json.dumps([str(rows)]), "--data.val_fraction", "0",
        "--data.max_length", "16384", "--data.batch_size", "1", "--data.use_cache", "false",
        "--model.objective.ttt_steps", "2", *LONG_CONTEXT_SETTINGS,
        "--trainer.max_steps", "2", "--trainer.limit_val_batches", "0", "--trainer.num_sanity_val_steps", "0",
        "--trainer.callbacks", "[]", "--trainer.logger", "false",
        "--trainer.enable_progress_bar", "false", "--trainer.enable_checkpointing", "false",
        "--trainer.default_root_dir", str(tmp_path / "run"),
    ]  # fmt: skip
    # A clean environment: what earlier tests of the session left in os.environ must not change the measured process.
    env = {k: os.environ[k] for k in ("PATH", "HOME", "TMPDIR", "LANG", "VIRTUAL_ENV") if k in os.environ}
    env.update(PROBE_ENV, OMP_NUM_THREADS="2", PYTHONPATH=str(REPO))
    result = subprocess.run(
        [sys.executable, "-c", _RUN, *args], capture_output=True, text=True, env=env, timeout=1200, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr[-4000:]
    line = next(x for x in result.stdout.splitlines() if x.startswith("RESULT "))
    max_rss = json.loads(line.removeprefix("RESULT "))["max_rss"]
    print(f"peak RSS of the 16K-token fit: {max_rss / 1e6:.0f} MB (rows of {min(lengths)}-{max(lengths)} tokens)")
    assert max_rss < PEAK_RSS_BOUND, max_rss

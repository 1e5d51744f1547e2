"""The whole-model KDA check (`k3_target.md` §10) and how ``backend="auto"`` consults its record.

On CPU the check runs chunk vs naive; the fla cases monkeypatch ``fla_kda_available`` (and ``fla_kda`` with a
stand-in computed by the chunked path), which is exactly the decision ``auto`` makes on a CUDA machine."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch

from lightning_eagle.commands.check_kda import main
from lightning_eagle.k3 import config_from_name, kda, kda_records
from lightning_eagle.k3.kda import KimiDeltaAttention, resolve_kda_backend
from lightning_eagle.k3.kda_compare import compare_kda_backends
from lightning_eagle.k3.kda_ops import chunk_kda
from lightning_eagle.k3.kda_records import (
    CHECKS_ENV,
    KDACheckResult,
    device_class_key,
    passed_kda_backends,
    record_kda_check,
)

CPU = torch.device("cpu")


@pytest.fixture
def record_path(tmp_path, monkeypatch):
    path = tmp_path / "checks" / "kda_checks.json"
    monkeypatch.setenv(CHECKS_ENV, str(path))
    return path


def test_cpu_check_passes_and_is_recorded(record_path, capsys):
    assert main(["--device", "cpu", "--seq-len", "40"]) == 0
    out = capsys.readouterr().out
    assert "chunk" in out and "PASS" in out and str(record_path) in out
    entry = json.loads(record_path.read_text())["checks"][device_class_key(CPU)]
    assert entry["device"] == "cpu" and entry["torch"] == torch.__version__
    assert entry["backends"]["chunk"]["passed"] is True
    assert 0 <= entry["backends"]["chunk"]["max_abs_diff"] <= entry["backends"]["chunk"]["tolerance"]
    assert passed_kda_backends(CPU) == {"chunk"}


def test_a_failing_backend_exits_nonzero_and_is_recorded_as_failed(record_path, capsys):
    record_kda_check(CPU, [KDACheckResult("chunk", 0.0, 1.0, True)])
    assert main(["--device", "cpu", "--seq-len", "24", "--backends", "chunk", "--rtol", "0"]) == 1
    assert "FAIL" in capsys.readouterr().out
    assert passed_kda_backends(CPU) == frozenset()  # the failure replaced the earlier pass


def test_a_backend_that_raises_fails_with_its_message():
    (result,) = compare_kda_backends(CPU, ["fla"], seq_len=8)  # fla cannot run on CPU
    assert not result.passed and result.max_abs_diff is None and result.error


def test_the_record_is_written_atomically(record_path, monkeypatch):
    record_kda_check(CPU, [KDACheckResult("chunk", 1e-6, 1e-3, True)])
    before = record_path.read_text()
    real_atomic_file = kda_records.atomic_file

    @contextlib.contextmanager
    def crashing_atomic_file(path):
        with real_atomic_file(path) as tmp:
            yield tmp
            assert tmp != record_path and tmp.parent == record_path.parent and tmp.read_text() != before
            assert record_path.read_text() == before  # the new content is not under the final name yet
            raise KeyboardInterrupt  # the writer dies before the rename

    monkeypatch.setattr(kda_records, "atomic_file", crashing_atomic_file)
    with pytest.raises(KeyboardInterrupt):
        record_kda_check(CPU, [KDACheckResult("chunk", 1.0, 1e-3, False)])
    assert record_path.read_text() == before
    assert sorted(p.name for p in record_path.parent.iterdir()) == [record_path.name]  # no partial left behind
    assert passed_kda_backends(CPU) == {"chunk"}


def _layer(backend: str) -> KimiDeltaAttention:
    torch.manual_seed(0)
    layer = KimiDeltaAttention(config_from_name("k3-tiny"), backend=backend)
    for p in layer.parameters():
        if p.dim() > 1:
            torch.nn.init.normal_(p, std=0.15)
        else:
            torch.nn.init.uniform_(p, 0.5, 1.5)
    return layer


@pytest.fixture
def fake_fla(monkeypatch):
    """Pretend fla is installed: ``fla_kda`` records its kernel and computes with the chunked torch path."""
    calls = []

    def fla_kda(q, k, v, g, beta, scale, kernel="fused_recurrent", **state):
        calls.append(kernel)
        return chunk_kda(q, k, v, g, beta, scale, 16, **state)

    monkeypatch.setattr(kda, "fla_kda_available", lambda device: True)
    monkeypatch.setattr(kda, "fla_kda", fla_kda)
    return calls


def test_auto_does_not_pick_fla_without_a_recorded_pass(record_path, fake_fla):
    x = torch.randn(2, 21, 128)
    chunk = _layer("chunk")(x)
    assert resolve_kda_backend("auto", CPU) == "chunk"
    assert torch.equal(_layer("auto")(x), chunk) and fake_fla == []
    record_kda_check(CPU, [KDACheckResult("fla", 5.0, 1e-3, False), KDACheckResult("fla_chunk", None, 1e-3, False)])
    assert torch.equal(_layer("auto")(x), chunk) and fake_fla == []  # recorded failures do not count either
    # explicit opt-in still runs fla
    _layer("fla")(x)
    assert fake_fla == ["fused_recurrent"]


def test_auto_picks_fla_after_a_recorded_pass(record_path, fake_fla, monkeypatch):
    x = torch.randn(2, 21, 128)
    record_kda_check(CPU, [KDACheckResult("fla", 1e-6, 1e-3, True)])
    assert resolve_kda_backend("auto", CPU) == "fla"
    torch.testing.assert_close(_layer("auto")(x), _layer("chunk")(x))
    assert fake_fla == ["fused_recurrent"]
    record_kda_check(CPU, [KDACheckResult("fla_chunk", 1e-6, 1e-3, True)])
    assert resolve_kda_backend("auto", CPU) == "fla_chunk"  # chunk kernel preferred once both passed
    # a pass is valid only for the device class it was recorded on (here: another fla version)
    monkeypatch.setattr(kda_records, "_version", lambda distribution: "9.9.9")
    assert resolve_kda_backend("auto", CPU) == "chunk"

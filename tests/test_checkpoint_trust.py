"""Checkpoints that run no code and cannot be mixed up: a crafted checkpoint is refused on
every load path, naming what it would run; a checkpoint is complete only when its manifest
says so, and a damaged newest one is passed over; one run saves into a directory at a
time; storage errors are told in one line."""

from __future__ import annotations

import functools
import json
import os
import pickle
import random
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import checkpoint_cases as cases
import numpy as np
import pytest
import torch
import trust_cases
from pipeline_cases import mlp
from training_cases import adamw

import pipetrain
from pipetrain import checkpoint
from pipetrain.app.cli import main
from pipetrain.checkpoint import directory, entries, lock, manifest
from pipetrain.checkpoint.manifest import CheckpointIntegrityError
from pipetrain.checkpoint.reader import UnsafeCheckpoint

RUNS_CODE = "(posix|os)\\.system"


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("trust")


@pytest.fixture(scope="module")
def saved(root: Path) -> list[dict[str, str]]:
    (root / "locked").mkdir()
    held = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
    (root / "locked" / lock.LOCK).write_text(json.dumps({**held, "token": "other-run"}))
    return pipetrain.launch(trust_cases.save_runs, 2, str(root), timeout_s=300)


@pytest.fixture(scope="module")
def honest(root: Path, saved: list[dict[str, str]]) -> Path:
    return root / "honest" / trust_cases.STEP


@pytest.fixture(scope="module")
def marker(root: Path) -> Path:
    return root / "marker"


@pytest.fixture(scope="module")
def crafted(root: Path, honest: Path, marker: Path) -> dict[str, Path]:
    command = f"touch {marker}"
    return {
        "metadata": trust_cases.evil_metadata(honest, root / "metadata" / "step-00000002", command),
        "entry": trust_cases.evil_entry(honest, root / "entry" / "step-00000002", command),
    }


@pytest.fixture(scope="module")
def old(root: Path, honest: Path) -> Path:
    return trust_cases.old_style(honest, root / "old" / trust_cases.STEP)


@pytest.fixture(scope="module")
def loaded(root: Path, crafted: dict[str, Path], old: Path) -> list[dict[str, str]]:
    names = ["honest", "metadata", "entry", "old"]
    return pipetrain.launch(trust_cases.load_runs, 2, str(root), names, timeout_s=300)


@pytest.mark.parametrize("kind", ["metadata", "entry"])
def test_pipe_load_refuses_a_crafted_checkpoint_on_every_rank_naming_what_it_would_run(
    loaded: list[dict[str, str]], marker: Path, kind: str
) -> None:
    for rank in loaded:
        assert rank["honest"] == "ok"
        assert rank[kind].startswith("UnsafeCheckpoint: ")
        assert re.search(RUNS_CODE, rank[kind])
    assert not marker.exists()


@pytest.mark.parametrize("kind", ["metadata", "entry"])
def test_every_load_path_in_one_process_refuses_a_crafted_checkpoint(
    crafted: dict[str, Path], marker: Path, tmp_path: Path, kind: str
) -> None:
    path = crafted[kind]
    model = mlp()
    paths: list[Any] = [
        lambda: checkpoint.load_full(path, model, adamw(model.parameters())),
        lambda: checkpoint.load_full(path.parent, model),
        lambda: checkpoint.export(path, tmp_path / "out.pt"),
        lambda: entries.read_everything(path),
    ]
    for load in paths:
        with pytest.raises(UnsafeCheckpoint, match=RUNS_CODE):
            load()
    assert main(["export", str(path), str(tmp_path / "cli.pt")]) == 2
    assert not marker.exists()
    assert not (tmp_path / "out.pt").exists()


def test_the_metadata_is_refused_before_any_file_is_read(crafted: dict[str, Path]) -> None:
    with pytest.raises(UnsafeCheckpoint, match=f"metadata names {RUNS_CODE}, which is not"):
        entries.contents(crafted["metadata"])


def test_an_old_checkpoint_is_refused_saying_how_to_load_it_and_loads_with_trust(
    loaded: list[dict[str, str]], old: Path, tmp_path: Path
) -> None:
    for rank in loaded:
        assert "has no manifest.json" in rank["old"] and "trust=True" in rank["old"]
    model = mlp(seed=5)
    with pytest.raises(CheckpointIntegrityError, match=r"no manifest\.json.*trust=True"):
        checkpoint.load_full(old, model)
    with (
        pytest.raises(FileNotFoundError, match=r"passed over step-00000002 .*trust=True"),
        pytest.warns(UserWarning, match="skipping step-00000002: .* no manifest"),
    ):
        checkpoint.load_full(old.parent, model)
    optimizer = adamw(model.parameters())
    found = checkpoint.load_full(old, model, optimizer, trust=True)
    assert found.step == cases.SAVED_AT and found.extra == {"next": cases.SAVED_AT}
    checkpoint.export(old.parent, tmp_path / "old.pt", trust=True)
    assert main(["export", "--trust", str(old), str(tmp_path / "cli.pt")]) == 0
    state = entries.read_everything(old, trust=True)
    assert isinstance(state["rng/0"]["numpy"][1], np.ndarray)
    entries.restore_random_states(state["rng/0"])  # the old form restores too


def test_what_a_save_holds_besides_tensors_loads_without_trust(honest: Path) -> None:
    state = entries.read_everything(honest)
    assert state[entries.EXTRA] == {"next": cases.SAVED_AT}
    assert state[entries.PROGRESS]["step"] == cases.SAVED_AT
    assert state[entries.LR_SCHEDULER] is not None and state[entries.PRECISION] is not None
    assert {"rng/0", "rng/1"} <= set(state)


def test_random_states_round_trip_through_a_weights_only_load(tmp_path: Path) -> None:
    torch.manual_seed(3)
    np.random.seed(3)
    states = entries.random_states()
    expected = (torch.rand(2), np.random.rand(2), random.random())
    torch.save(states, tmp_path / "rng.pt")
    entries.restore_random_states(torch.load(tmp_path / "rng.pt", weights_only=True))
    got = (torch.rand(2), np.random.rand(2), random.random())
    assert torch.equal(got[0], expected[0])
    assert np.array_equal(got[1], expected[1]) and got[2] == expected[2]


def test_an_extra_that_would_not_load_safely_is_refused_at_save_on_every_rank(
    saved: list[dict[str, str]], root: Path
) -> None:
    for rank in saved:
        assert rank["bad_extra"] == (
            "ValueError: extra['x'] is a set; a checkpoint's extra holds only dicts, lists, "
            "tuples, strings, numbers, booleans, None and tensors, so that loading it runs "
            "no code"
        )
    assert directory.latest(root / "bad") is None
    assert entries.extra_problem({"a": [1, 2.0, "x", None, True, (torch.ones(1),)]}) is None
    assert entries.extra_problem(Path("x")) is not None
    assert entries.extra_problem({(1, 2): 3}) == "extra has a key of type tuple"


def _corrupt(honest: Path, out: Path, damage: Any) -> Path:
    shutil.copytree(honest, out)
    damage(out)
    return out


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    for k in range(len(data) - 64, len(data) - 48):
        data[k] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-100])


DAMAGE = {
    "flipped": (lambda d: _flip(d / "__1_0.distcp"), "__1_0.distcp's checksum differs"),
    "truncated": (lambda d: _truncate(d / "__0_0.distcp"), r"__0_0.distcp is \d+ bytes"),
    "missing": (lambda d: (d / "__1_0.distcp").unlink(), "__1_0.distcp is missing"),
    "metadata": (lambda d: _truncate(d / ".metadata"), r"\.metadata is \d+ bytes"),
    "unfinished": (lambda d: (d / "manifest.json").unlink(), "has no manifest.json"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_newest_checkpoint_is_passed_over_with_a_warning_and_refused_by_name(
    honest: Path, tmp_path: Path, damage: str
) -> None:
    harm, problem = DAMAGE[damage]
    shutil.copytree(honest, tmp_path / trust_cases.STEP)
    broken = _corrupt(honest, tmp_path / "step-00000003", harm)
    with pytest.warns(UserWarning, match=f"skipping step-00000003: .*{problem}"):
        assert directory.resolve(tmp_path) == tmp_path / trust_cases.STEP
    model = mlp(seed=5)
    with pytest.warns(UserWarning, match="skipping step-00000003"):
        assert checkpoint.load_full(tmp_path, model).step == cases.SAVED_AT
    with pytest.raises(CheckpointIntegrityError, match=f"^the checkpoint {broken} .*{problem}"):
        checkpoint.load_full(broken, model)
    with pytest.raises(CheckpointIntegrityError, match=problem):
        checkpoint.export(broken, tmp_path / "out.pt")
    if damage != "flipped":  # only the checksums find a flipped byte
        assert directory.latest(tmp_path) == tmp_path / trust_cases.STEP


def _doctor(path: Path, key: str, chunk_too: bool) -> None:
    with open(path / manifest.METADATA, "rb") as file:
        metadata = pickle.load(file)  # our own honest file
    entry = metadata.state_dict_metadata[key]
    entry.size = torch.Size([2 * entry.size[0], *entry.size[1:]])
    if chunk_too:
        entry.chunks[0].sizes = entry.size
    with open(path / manifest.METADATA, "wb") as file:
        pickle.dump(metadata, file)
    manifest.write(path)  # the manifest vouches for the doctored metadata


@pytest.mark.parametrize(
    ("chunk_too", "problem"),
    [
        (False, r"the chunks of model/0.weight do not cover its size \[24, 6\]"),
        (True, r"its data does not match its metadata \(.*model/0.weight.*\[24, 6\]"),
    ],
)
def test_metadata_claiming_a_larger_tensor_than_its_data_is_refused(
    honest: Path, tmp_path: Path, chunk_too: bool, problem: str
) -> None:
    path = _corrupt(
        honest,
        tmp_path / "doctored",
        functools.partial(_doctor, key="model/0.weight", chunk_too=chunk_too),
    )
    for trust in (False, True):
        with pytest.raises(CheckpointIntegrityError, match=problem):
            checkpoint.export(path, tmp_path / "out.pt", trust=trust)
    assert not (tmp_path / "out.pt").exists()


def test_a_prune_removes_the_manifest_first(honest: Path, tmp_path: Path, monkeypatch: Any) -> None:
    for step in (2, 3):
        shutil.copytree(honest, directory.step_path(tmp_path, step))
    monkeypatch.setattr(directory.shutil, "rmtree", lambda *args, **kwargs: None)  # killed here
    assert directory.prune(tmp_path, keep=1) == [directory.step_path(tmp_path, 2)]
    assert directory.checkpoints(tmp_path) == [directory.step_path(tmp_path, 3)]


def test_a_second_live_run_is_refused_naming_the_owner(
    saved: list[dict[str, str]], root: Path
) -> None:
    for rank in saved:
        assert f"is in use by another run: pid {os.getpid()} on this host" in rank["locked"]
    assert (root / "locked" / lock.LOCK).exists()
    assert not (root / "honest" / lock.LOCK).exists(), "the run's lock ends with it"
    assert not [p for p in os.listdir(root / "honest") if p.startswith(".step")]


def test_a_dead_owners_lock_is_taken_over_and_another_hosts_is_not(tmp_path: Path) -> None:
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        owner = {"host": socket.gethostname(), "pid": sleeper.pid, "started": time.time()}
        (tmp_path / lock.LOCK).write_text(json.dumps({**owner, "token": "theirs"}))
        (tmp_path / ".step-00000001.theirs.tmp").mkdir()
        with pytest.raises(lock.DirectoryLocked, match=f"pid {sleeper.pid} on this host"):
            directory.clear_temporary(tmp_path)
        assert (tmp_path / ".step-00000001.theirs.tmp").exists(), "a live run's work is kept"
    finally:
        sleeper.kill()
        sleeper.wait()
    directory.clear_temporary(tmp_path)
    token = lock.token(tmp_path)
    assert token is not None and token.startswith(f"{os.getpid()}-")
    assert not (tmp_path / ".step-00000001.theirs.tmp").exists()
    assert directory.temporary_path(tmp_path, 4).name == f".step-00000004.{token}.tmp"
    assert lock.acquire(tmp_path) == token, "the owner keeps its lock"
    lock.release(tmp_path)
    away = {"host": "elsewhere", "pid": os.getpid(), "started": time.time(), "token": "x"}
    (tmp_path / lock.LOCK).write_text(json.dumps(away))
    with pytest.raises(lock.DirectoryLocked, match="on host elsewhere"):
        lock.acquire(tmp_path)


def test_a_full_disk_is_one_line_naming_the_path_and_the_unfinished_save_is_removed(
    tmp_path: Path,
) -> None:
    path = tmp_path / ".step-00000001.run.tmp"
    path.mkdir()
    (path / "__0_0.distcp").symlink_to("/dev/full")
    with pytest.raises(RuntimeError) as failure:
        entries.write({"model/w": torch.ones(1000)}, path, None)
    message = str(failure.value)
    assert message.startswith(f"could not write the checkpoint {path} on rank 0: no space left")
    assert "ENOSPC" in message and "\n" not in message
    assert not path.exists()

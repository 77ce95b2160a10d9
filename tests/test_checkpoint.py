"""Checkpoints: round trips (bf16, optax states, PRNG keys, sharded arrays onto other device
counts), asynchronous saves, atomicity under failures, keep-last-N, refusal of corrupt files,
unwritable folders found early and failed saves reported in one line, falling back past a
damaged latest checkpoint, partial (parameters only) restores. The sharded tests use the 8
emulated CPU devices that conftest.py asks for."""

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from blujax.checkpoint import (NO_MANIFEST, Checkpointer, CheckpointError,
                               CorruptCheckpointError, EarlierLayout)


@dataclasses.dataclass
class Config:
    n_layer: int = 3
    lr: float = 6e-4
    name: str = "gpt2-test"


def make_state(rng):
    params = {"wte": jnp.asarray(rng.standard_normal((37, 12)), jnp.float32),
              "blocks": [{"w": jnp.asarray(rng.standard_normal((12, 5)), jnp.bfloat16),
                          "b": jnp.asarray(rng.standard_normal(5), jnp.float16)}
                         for _ in range(2)]}
    opt = optax.adamw(1e-3)
    opt_state = opt.init(params)
    grads = jax.tree.map(lambda p: jnp.ones_like(p) * 0.5, params)
    _, opt_state = opt.update(grads, opt_state, params)  # mu, nu, count not zero
    return {"params": params, "opt_state": opt_state, "rng": jax.random.key(42),
            "raw_key": jax.random.PRNGKey(7), "mask": np.array([True, False, True]),
            "ema": np.asarray(rng.standard_normal(4), np.float64), "scale": 0.25,
            "tokens_seen": np.int64(123_456_789_012)}


def assert_trees_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b)):
        if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            assert jax.random.key_impl(x) == jax.random.key_impl(y)
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        assert type(x) is type(y) or (isinstance(x, jax.Array) and isinstance(y, jax.Array)), \
            (path, type(x), type(y))
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape, jax.tree_util.keystr(path)
        assert x.tobytes() == y.tobytes(), jax.tree_util.keystr(path)  # bit for bit


def test_round_trip(tmp_path, rng):
    state = make_state(rng)
    loader = {"epoch": 1, "batch": 17, "seed": 0, "shards": "abc"}
    with Checkpointer(tmp_path) as ckpt:
        info = ckpt.save(100, state, loader=loader, config=Config())
        assert isinstance(info.stall_s, float) and info.stall_s >= 0
        assert ckpt.wait() is info and info.write_s > 0
        restored = ckpt.restore(like=state)
        meta = ckpt.metadata()
    assert restored.step == 100 and meta["step"] == 100
    assert restored.loader == loader == meta["loader"]
    assert Config(**restored.config) == Config()
    assert_trees_equal(state, restored.tree)
    assert restored.tree["params"]["blocks"][0]["w"].dtype == jnp.bfloat16
    # Without a template: a flat dict of numpy arrays by key path.
    raw = Checkpointer(tmp_path).restore().tree
    assert raw["['params']['blocks'][1]['w']"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(raw["['opt_state'][0].mu['wte']"],
                                  state["opt_state"][0].mu["wte"])
    np.testing.assert_array_equal(raw["['rng']"], jax.random.key_data(state["rng"]))


def sharded_tree(rng, mesh):
    """Arrays laid out over a 4 x 2 mesh in several ways, with their host values."""
    specs = {"both": ((16, 12), jnp.float32, P("data", "model")),
             "rows": ((8, 6), jnp.bfloat16, P("model", None)),
             "flat8": ((24, 5), jnp.float32, P(("data", "model"), None)),
             "replicated": ((10,), jnp.float32, P()),
             "odd": ((5, 3), jnp.int32, P())}
    host = {k: np.asarray(jnp.asarray(rng.standard_normal(s) * 100, d))
            for k, (s, d, _) in specs.items()}
    tree = {k: jax.device_put(host[k], NamedSharding(mesh, spec))
            for k, (_, _, spec) in specs.items()}
    return host, tree


def cpu_devices(n):
    devices = jax.devices("cpu")
    if len(devices) < n:
        pytest.skip(f"needs {n} CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count)")
    return devices


def test_sharded_restore_onto_other_device_counts(tmp_path, rng):
    devices = cpu_devices(8)
    mesh8 = Mesh(np.array(devices[:8]).reshape(4, 2), ("data", "model"))
    host, tree = sharded_tree(rng, mesh8)
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"params": tree, "key": jax.random.key(3)})
    manifest = json.loads((tmp_path / "step_00000001" / "manifest.json").read_text())
    chunks = {r["path"]: len(r["chunks"]) for r in manifest["arrays"]}
    assert chunks["['params']['both']"] == 8 and chunks["['params']['rows']"] == 2
    assert chunks["['params']['replicated']"] == 1  # replicas are written once

    mesh4 = Mesh(np.array(devices[4:8]).reshape(2, 2), ("data", "model"))
    mesh1 = Mesh(np.array(devices[7:8]).reshape(1, 1), ("data", "model"))
    layouts = {
        "same mesh": tree,
        "4 devices": {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(
            mesh4, {"both": P(None, "data"), "odd": P()}.get(k, P("data"))))
            for k, v in tree.items()},
        "1 device": {k: jax.ShapeDtypeStruct(v.shape, v.dtype,
                                             sharding=NamedSharding(mesh1, P()))
                     for k, v in tree.items()},
    }
    for label, like in layouts.items():
        key_like = jax.device_put(jax.random.key(0), NamedSharding(mesh4, P()))
        out = Checkpointer(tmp_path).restore(like={"params": like, "key": key_like})
        for k, want in host.items():
            got = out.tree["params"][k]
            assert got.sharding.is_equivalent_to(like[k].sharding, got.ndim), (label, k)
            assert got.dtype == want.dtype
            assert np.asarray(got).tobytes() == want.tobytes(), (label, k)
        assert out.tree["key"].sharding == key_like.sharding
        np.testing.assert_array_equal(jax.random.key_data(out.tree["key"]),
                                      jax.random.key_data(jax.random.key(3)))


def array_file(ckpt_dir, name, chunk=0):
    manifest = json.loads((ckpt_dir / "manifest.json").read_text())
    record = next(r for r in manifest["arrays"] if r["path"] == name)
    return ckpt_dir / record["chunks"][chunk]["file"]


def test_corrupt_checkpoint_is_refused(tmp_path, rng):
    state = make_state(rng)
    ckpt = Checkpointer(tmp_path, async_save=False)
    ckpt.save(5, state)
    step_dir = tmp_path / "step_00000005"

    def damage(path, how):
        raw = bytearray(path.read_bytes())
        if how == "flip":
            raw[len(raw) // 2] ^= 0x04
        else:
            raw = raw[:-2]
        path.write_bytes(bytes(raw))

    name = "['params']['blocks'][1]['w']"
    damage(array_file(step_dir, name), "flip")
    with pytest.raises(CheckpointError, match=r"array \['params'\]\['blocks'\]\[1\]\['w'\] "
                                              r".*checksum mismatch"):
        ckpt.restore(like=state)

    ckpt.save(5, state)  # a fresh, good copy of step 5 replaces the damaged one
    assert_trees_equal(state, ckpt.restore(like=state).tree)
    damage(array_file(step_dir, "['opt_state'][0].nu['wte']"), "truncate")
    with pytest.raises(CheckpointError, match=r"nu\['wte'\].*truncated: 1774 bytes, "
                                              r"expected 1776"):
        ckpt.restore(like=state)
    with pytest.raises(CheckpointError, match="truncated"):
        ckpt.restore()

    ckpt.save(5, state)
    manifest = step_dir / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"step": 5', '"step": 6'))
    with pytest.raises(CheckpointError, match="manifest.json fails its checksum"):
        ckpt.restore(like=state)
    manifest.write_text("{not json")
    with pytest.raises(CheckpointError, match="manifest.json is corrupt"):
        ckpt.metadata()


def test_failed_save_leaves_previous_checkpoint(tmp_path, rng, monkeypatch):
    state = make_state(rng)
    ckpt = Checkpointer(tmp_path)
    ckpt.save(1, state)
    ckpt.wait()
    later = jax.tree.map(lambda x: x, state)
    later["params"]["wte"] = state["params"]["wte"] + 1

    # An exception in the middle of writing the arrays (the disk fails, say) ...
    calls = []
    real_fsync = os.fsync

    def failing_fsync(fd):
        calls.append(fd)
        if len(calls) == 4:
            raise OSError(28, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", failing_fsync)
    ckpt.save(2, later)
    # One line naming the checkpoint and the reason (the CLI prints it as `error: ...`).
    with pytest.raises(CheckpointError, match=r"^cannot write checkpoint of step 2 to \S*"
                                              r"step_00000002: \[Errno 28\] No space left on "
                                              r"device$"):
        ckpt.wait()
    monkeypatch.setattr(os, "fsync", real_fsync)

    # ... or between writing everything and the rename that makes it the checkpoint.
    def crash(tmp, final):
        raise RuntimeError("simulated crash before the rename")

    monkeypatch.setattr(Checkpointer, "_commit", staticmethod(crash))
    ckpt.save(3, later)
    with pytest.raises(RuntimeError, match="simulated crash"):
        ckpt.wait()
    monkeypatch.undo()

    assert ckpt.steps() == [1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001"]
    restored = Checkpointer(tmp_path).restore(like=state)
    assert restored.step == 1
    assert_trees_equal(state, restored.tree)


def test_killed_save_leaves_previous_checkpoint(tmp_path):
    # A real crash: the process dies (os._exit) after writing step 2, before renaming it.
    script = textwrap.dedent("""
        import os, sys
        import jax.numpy as jnp
        from blujax.checkpoint import Checkpointer
        ckpt = Checkpointer(sys.argv[1], async_save=False)
        ckpt.save(1, {"w": jnp.arange(10.0)})
        Checkpointer._commit = lambda self, tmp, final: os._exit(3)
        ckpt.save(2, {"w": jnp.arange(10.0) * 2})
    """)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    run = subprocess.run([sys.executable, "-c", script, str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 3, run.stderr
    assert any(p.name.startswith(".tmp-step_00000002") for p in tmp_path.iterdir())
    ckpt = Checkpointer(tmp_path)  # tidies the leftover temporary directory
    assert ckpt.steps() == [1] and ckpt.latest_step() == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001"]
    out = ckpt.restore(like={"w": jnp.zeros(10)})
    np.testing.assert_array_equal(out.tree["w"], np.arange(10.0))

    # Killed between moving an older copy of a step aside and renaming the new one in.
    os.rename(tmp_path / "step_00000001", tmp_path / ".old-step_00000001-0123abcd")
    assert Checkpointer(tmp_path).steps() == [1]


def test_read_only_leaves_the_directory_alone(tmp_path):
    """A reader beside a run that is saving: it neither creates nor tidies the directory, so
    a save under way in its temporary folder survives, and it cannot save."""
    missing = tmp_path / "not-yet"
    assert Checkpointer(missing, read_only=True).steps() == []
    assert not missing.exists()
    with pytest.raises(FileNotFoundError, match="no checkpoint in"):
        Checkpointer(missing, read_only=True).restore()

    writer = Checkpointer(tmp_path, async_save=False)
    writer.save(1, {"w": jnp.arange(10.0)})
    in_flight = tmp_path / ".tmp-step_00000002-0123abcd"
    (in_flight / "arrays").mkdir(parents=True)
    reader = Checkpointer(tmp_path, read_only=True)
    assert in_flight.is_dir()
    assert reader.steps() == [1]
    np.testing.assert_array_equal(reader.restore(like={"w": jnp.zeros(10)}).tree["w"],
                                  np.arange(10.0))
    with pytest.raises(CheckpointError, match="read_only=True"):
        reader.save(2, {"w": jnp.arange(10.0)})
    reader.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == [in_flight.name, "step_00000001"]
    Checkpointer(tmp_path)  # opened for writing, it tidies
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001"]


def test_keep_last_n(tmp_path, rng):
    ckpt = Checkpointer(tmp_path, keep=2)
    x = jnp.asarray(rng.standard_normal(7), jnp.float32)
    for step in range(1, 6):
        ckpt.save(step, {"x": x * step})
    ckpt.wait()
    assert ckpt.steps() == [4, 5]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000004", "step_00000005"]
    np.testing.assert_array_equal(ckpt.restore(like={"x": x}, step=4).tree["x"], x * 4)
    with pytest.raises(FileNotFoundError, match=r"no checkpoint of step 1 .*\[4, 5\]"):
        ckpt.restore(like={"x": x}, step=1)
    ckpt.save(5, {"x": x * 50})  # the same step again replaces it
    assert ckpt.latest_step() == 5 and ckpt.steps() == [4, 5]
    np.testing.assert_array_equal(ckpt.restore(like={"x": x}).tree["x"], x * 50)
    with pytest.raises(ValueError, match="keep must be at least 1"):
        Checkpointer(tmp_path, keep=0)


def test_async_save_snapshots_and_reports_stall(tmp_path, rng, monkeypatch):
    host = rng.standard_normal((64, 64)).astype(np.float32)
    params = {"w": jnp.asarray(host), "n": host.copy()}
    # Slow writes: the save must still return at once, with the arrays as they were.
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (time.sleep(0.05), real_fsync(fd)))
    ckpt = Checkpointer(tmp_path)
    info = ckpt.save(1, params)
    assert ckpt.in_flight()
    step = jax.jit(lambda p: jax.tree.map(lambda a: a * 3, p), donate_argnums=0)
    params["n"] *= 0  # the caller changes a numpy array in place ...
    params = step({"w": params["w"], "n": jnp.asarray(params["n"])})  # ... and donates w
    jax.block_until_ready(params)
    assert ckpt.wait() is info
    assert info.stall_s < info.write_s and info.write_s >= 0.05
    out = ckpt.restore(like={"w": jnp.zeros((64, 64)), "n": np.zeros((64, 64), np.float32)})
    np.testing.assert_array_equal(out.tree["w"], host)
    np.testing.assert_array_equal(out.tree["n"], host)
    assert isinstance(out.tree["n"], np.ndarray)


def test_restore_mismatches_and_bad_saves(tmp_path, rng):
    state = {"a": jnp.ones((3, 4), jnp.float32), "b": {"c": jnp.zeros(2, jnp.int32)}}
    ckpt = Checkpointer(tmp_path, async_save=False)
    with pytest.raises(FileNotFoundError, match="no checkpoint in"):
        ckpt.restore(like=state)
    ckpt.save(0, state)
    with pytest.raises(CheckpointError, match=r"not in the checkpoint: \['d'\]; in the "
                                              r"checkpoint but not in the tree: \['a'\]"):
        ckpt.restore(like={"d": state["a"], "b": state["b"]})
    with pytest.raises(CheckpointError, match=r"\['a'\] has shape \[3, 4\], the tree \[4, 3\]"):
        ckpt.restore(like={"a": jnp.ones((4, 3)), "b": state["b"]})
    with pytest.raises(CheckpointError, match=r"\['a'\] is float32, the tree bfloat16"):
        ckpt.restore(like={"a": jnp.ones((3, 4), jnp.bfloat16), "b": state["b"]})
    with pytest.raises(CheckpointError, match="not a PRNG key there"):
        ckpt.restore(like={"a": state["a"], "b": {"c": jax.random.key(0)}})
    with pytest.raises(ValueError, match="step must be >= 0"):
        ckpt.save(-1, state)
    with pytest.raises(TypeError, match=r"cannot save leaf \['s'\] of type str"):
        ckpt.save(1, {"s": "text"})
    with pytest.raises(TypeError, match="JSON-serializable"):
        ckpt.save(1, state, config={"f": object()})
    assert ckpt.steps() == [0]


# --------------------------------------------------------------------------------------------
# A folder that cannot take checkpoints: found before training, or at a save as one line.
# (The tests run as root here, where chmod stops no writes: failures are simulated as well.)


def test_unwritable_folder_is_found_before_training(tmp_path, monkeypatch):
    a_file = tmp_path / "ckpt"
    a_file.write_text("not a folder")
    with pytest.raises(CheckpointError, match=rf"^cannot open checkpoint folder {a_file} for "
                                              r"writing: it is a file, not a folder$"):
        Checkpointer(a_file)
    with pytest.raises(CheckpointError, match=r"^cannot open checkpoint folder \S*ckpt/sub for "
                                              r"writing: \[Errno 20\] Not a directory$"):
        Checkpointer(a_file / "sub")

    folder = tmp_path / "run" / "ckpt"
    ckpt = Checkpointer(folder)
    ckpt.check_writable()  # leaves nothing behind
    assert list(folder.iterdir()) == []
    real_fsync = os.fsync

    def refused(fd):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "fsync", refused)
    with pytest.raises(CheckpointError, match=rf"^cannot write checkpoints to {folder}: "
                                              r"\[Errno 13\] Permission denied$"):
        ckpt.check_writable()
    assert list(folder.iterdir()) == []  # the probe is removed
    monkeypatch.setattr(os, "fsync", real_fsync)

    # The folder made unusable after the Checkpointer was opened: replaced by a file.
    folder.rmdir()
    folder.write_text("")
    with pytest.raises(CheckpointError, match=r"it is a file, not a folder"):
        ckpt.check_writable()
    folder.unlink()
    ckpt.check_writable()  # made again
    assert folder.is_dir()
    with pytest.raises(CheckpointError, match=r"one takes [\d,.]+ MiB and the disk has "):
        ckpt.check_writable(nbytes=2**70)
    with pytest.raises(CheckpointError, match="read_only=True"):
        Checkpointer(folder, read_only=True).check_writable()


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0,
                    reason="root writes into a read-only folder")
def test_read_only_folder(tmp_path):
    folder = tmp_path / "ckpt"
    ckpt = Checkpointer(folder, async_save=False)
    folder.chmod(0o500)
    try:
        with pytest.raises(CheckpointError, match=r"Permission denied"):
            ckpt.check_writable()
        with pytest.raises(CheckpointError, match=r"^cannot write checkpoint of step 1 to "
                                                  r"\S*step_00000001: \[Errno 13\] Permission"):
            ckpt.save(1, {"w": jnp.arange(3.0)})
    finally:
        folder.chmod(0o700)


def test_failed_background_save_stops_promptly(tmp_path, rng, monkeypatch):
    state = make_state(rng)
    ckpt = Checkpointer(tmp_path)
    ckpt.raise_if_failed()  # nothing saved yet
    ckpt.save(1, state)
    info = ckpt.wait()
    ckpt.raise_if_failed()

    # While a write runs, raise_if_failed returns at once; once it has failed, it raises.
    go = threading.Event()
    real_rename = os.rename

    def refused_rename(src, dst):
        go.wait(30)
        if ".tmp-step_" in str(src):
            raise PermissionError(13, "Permission denied", str(src))
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", refused_rename)
    ckpt.save(2, state)
    ckpt.raise_if_failed()
    assert ckpt.in_flight()
    go.set()
    deadline = time.monotonic() + 30
    with pytest.raises(CheckpointError) as raised:
        while time.monotonic() < deadline:
            ckpt.raise_if_failed()
            time.sleep(0.01)
    message = str(raised.value)
    assert message == (f"cannot write checkpoint of step 2 to {tmp_path / 'step_00000002'}: "
                       f"[Errno 13] Permission denied"), message
    assert not ckpt.in_flight()
    ckpt.raise_if_failed()  # raised once
    assert ckpt.wait() is None
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001"]  # no temp folder

    # A write that succeeded: raise_if_failed leaves its SaveInfo to wait().
    info = ckpt.save(3, state)
    while ckpt.in_flight():
        time.sleep(0.01)
    ckpt.raise_if_failed()
    assert ckpt.wait() is info and ckpt.steps() == [1, 3]

    # Synchronous saves raise it at once; the file write itself refused, this time.
    sync = Checkpointer(tmp_path, async_save=False)
    real_open = open

    def refused_open(file, mode="r", *args, **kwargs):
        if "w" in mode and "arrays" in str(file):
            raise OSError(30, "Read-only file system", str(file))
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr("builtins.open", refused_open)
    with pytest.raises(CheckpointError, match=r"^cannot write checkpoint of step 4 to \S*"
                                              r"step_00000004: \[Errno 30\] Read-only file "
                                              r"system$"):
        sync.save(4, state)
    monkeypatch.undo()
    assert sync.steps() == [1, 3]
    assert_trees_equal(state, sync.restore(like=state).tree)


def test_save_over_a_damaged_step_and_prune_around_damage(tmp_path, rng, monkeypatch):
    x = jnp.asarray(rng.standard_normal(7), jnp.float32)
    ckpt = Checkpointer(tmp_path, keep=2, async_save=False)
    for step in (1, 2, 3):
        ckpt.save(step, {"x": x * step})
    assert ckpt.steps() == [2, 3]
    # Damage: step 3's manifest deleted, step 5 a file, step 4 a folder with junk in it.
    (tmp_path / "step_00000003" / "manifest.json").unlink()
    (tmp_path / "step_00000005").write_text("junk")
    (tmp_path / "step_00000004").mkdir()
    (tmp_path / "step_00000004" / "junk").write_text("junk")
    assert ckpt.steps() == [2] and ckpt.incomplete_steps() == [3, 4, 5]
    # The run goes on from step 2 and saves over each of them.
    for step in (3, 4, 5):
        ckpt.save(step, {"x": x * step * 10})
        np.testing.assert_array_equal(ckpt.restore({"x": x}, step).tree["x"], x * step * 10)
    assert ckpt.steps() == [4, 5] and ckpt.incomplete_steps() == []
    assert ckpt.restore({"x": x}, fallback=True, on_skip=no_skip).step == 5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000004", "step_00000005"]
    np.testing.assert_array_equal(ckpt.restore(like={"x": x}).tree["x"], x * 5 * 10)

    # A step folder without a manifest older than every one kept is pruned; a newer one is
    # left for the save of its step to replace.
    (tmp_path / "step_00000001").mkdir()
    (tmp_path / "step_00000009").mkdir()
    ckpt.save(6, {"x": x})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000005", "step_00000006",
                                                          "step_00000009"]

    # Another process sharing the folder prunes the same checkpoint first.
    real_rename = os.rename

    def raced_rename(src, dst):
        if ".trash-" in str(dst):
            shutil.rmtree(src)
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", raced_rename)
    ckpt.save(7, {"x": x})
    monkeypatch.undo()
    assert ckpt.steps() == [6, 7]


# --------------------------------------------------------------------------------------------
# A damaged latest checkpoint: fall back to the newest that verifies; partial restores.


def no_skip(path, why):
    pytest.fail(f"skipped {path}: {why}")


def flip_byte(path):
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    path.write_bytes(bytes(raw))


def three_checkpoints(tmp_path, rng):
    states = []
    ckpt = Checkpointer(tmp_path, keep=3, async_save=False)
    for step in (1, 2, 3):
        state = make_state(rng)
        ckpt.save(step, state, loader={"batch": step})
        states.append(state)
    return ckpt, states


def test_restore_falls_back_past_a_corrupt_checkpoint(tmp_path, rng):
    ckpt, states = three_checkpoints(tmp_path, rng)
    like = states[0]
    r = ckpt.restore(like, fallback=True, on_skip=no_skip)
    assert r.step == 3 and r.loader == {"batch": 3}
    assert_trees_equal(states[2], r.tree)

    step3 = tmp_path / "step_00000003"
    flip_byte(array_file(step3, "['params']['wte']"))
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
        ckpt.restore(like=like)
    skipped = []
    r = ckpt.restore(like, fallback=True,
                     on_skip=lambda path, why: skipped.append((path, why)))
    assert r.step == 2 and r.loader == {"batch": 2} and r.path == tmp_path / "step_00000002"
    assert_trees_equal(states[1], r.tree)  # bit for bit
    (path, why), = skipped
    assert path == step3
    assert why.startswith("array ['params']['wte'] (arrays/") and "checksum mismatch" in why
    # The parameters of a corrupt checkpoint are not restored in part either.
    r = ckpt.restore({"params": like["params"]}, fallback=True, partial=True,
                     on_skip=lambda *a: None)
    assert r.step == 2

    # Step 2's manifest deleted as well: skipped, reported, and step 1 restored.
    (tmp_path / "step_00000002" / "manifest.json").unlink()
    assert ckpt.steps() == [1, 3] and ckpt.incomplete_steps() == [2]
    skipped = []
    r = ckpt.restore(like, fallback=True,
                     on_skip=lambda path, why: skipped.append((path.name, why)))
    assert r.step == 1
    assert_trees_equal(states[0], r.tree)
    assert [name for name, _ in skipped] == ["step_00000003", "step_00000002"]
    assert skipped[1][1] == NO_MANIFEST

    # A tree that does not match is no reason to fall back.
    wrong = dict(like, scale=np.zeros(3))
    with pytest.raises(CheckpointError, match=r"\['scale'\] has shape \[\], the tree \[3\]") \
            as raised:
        ckpt.restore(wrong, fallback=True, on_skip=lambda *a: None)
    assert not isinstance(raised.value, CorruptCheckpointError)

    # None verifies: one error naming each one tried.
    (tmp_path / "step_00000001" / "manifest.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=rf"^no checkpoint in {tmp_path} can be restored: "
                                              r"step_00000003: array .*checksum mismatch.*; "
                                              rf"step_00000002: {re.escape(NO_MANIFEST)}; "
                                              r"step_00000001: manifest.json is corrupt"):
        ckpt.restore(like, fallback=True)
    with pytest.raises(FileNotFoundError, match="no checkpoint in"):
        Checkpointer(tmp_path / "empty").restore(like, fallback=True)


def test_partial_restore_reads_only_its_arrays(tmp_path, rng):
    ckpt, states = three_checkpoints(tmp_path, rng)
    params_like = {"params": states[0]["params"]}
    with pytest.raises(CheckpointError, match="in the checkpoint but not in the tree"):
        ckpt.restore(like=params_like)  # the default stays strict
    with pytest.raises(CheckpointError, match=r"not in the checkpoint: \['params'\]\['nope'\]"):
        ckpt.restore(like={"params": {"nope": jnp.zeros(2)}}, partial=True)

    step3 = tmp_path / "step_00000003"
    flip_byte(array_file(step3, "['opt_state'][0].nu['wte']"))
    # The parameters of step 3 verify: eval and sample use them ...
    r = ckpt.restore(like=params_like, partial=True)
    assert r.step == 3 and list(r.tree) == ["params"]
    assert_trees_equal({"params": states[2]["params"]}, r.tree)
    r = ckpt.restore(params_like, fallback=True, partial=True, on_skip=no_skip)
    assert r.step == 3
    # ... while resuming, which needs the optimizer state too, falls back.
    skipped = []
    r = ckpt.restore(states[0], fallback=True,
                     on_skip=lambda path, why: skipped.append(why))
    assert r.step == 2
    assert len(skipped) == 1 and "['opt_state'][0].nu['wte']" in skipped[0]
    # The manifest is checked all the same.
    manifest = step3 / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"batch": 3', '"batch": 4'))
    with pytest.raises(CorruptCheckpointError, match="manifest.json fails its checksum"):
        ckpt.restore(like=params_like, partial=True)


def test_loop_restore_latest_warns_per_skipped_checkpoint(tmp_path, rng):
    from blujax import loop

    ckpt = Checkpointer(tmp_path, async_save=False)
    states = []
    for step in (4, 8, 12):
        state = make_state(rng)
        ckpt.save(step, state, loader={"batch": step})
        states.append(state)
    step12, step8 = (tmp_path / f"step_{n:08d}" for n in (12, 8))

    mu = array_file(step12, "['opt_state'][0].mu['wte']")
    flip_byte(mu)
    warnings = []
    r = loop.restore_latest(tmp_path, states[0], params_only=True, warn=warnings.append)
    assert r.step == 12 and list(r.tree) == ["params"] and warnings == []
    assert_trees_equal({"params": states[2]["params"]}, r.tree)
    r = loop.restore_latest(tmp_path, states[0], warn=warnings.append)
    assert r.step == 8 and r.loader == {"batch": 8}
    assert_trees_equal(states[1], r.tree)
    assert warnings == [
        f"warning: checkpoint {step12} is corrupt (array ['opt_state'][0].mu['wte'] "
        f"({mu.relative_to(step12)}): checksum mismatch: the data is corrupt): skipped; "
        f"restoring step 8 instead"]

    warnings.clear()
    (step8 / "manifest.json").unlink()
    r = loop.restore_latest(tmp_path, states[0], warn=warnings.append)
    assert r.step == 4
    assert len(warnings) == 2 and warnings[1] == (
        f"warning: {step8} has no manifest.json (deleted or never finished): skipped; "
        f"restoring step 4 instead")
    assert loop.restore_latest(tmp_path, states[0]).step == 4  # warn=None: silent
    assert ckpt.steps() == [4, 12]  # the complete ones, as before

    for step_dir in (step12, tmp_path / "step_00000004"):
        flip_byte(array_file(step_dir, "['params']['wte']"))
    with pytest.raises(CheckpointError, match=r"^no checkpoint in \S+ can be restored: "
                                              r"step_00000012: .*; step_00000008: .*; "
                                              r"step_00000004: array \['params'\]\['wte'\]"):
        loop.restore_latest(tmp_path, states[0], params_only=True, warn=warnings.append)


# --------------------------------------------------------------------------------------------
# A tree whose layout changed since it was saved: the stored shapes pick the layout.


def test_a_checkpoint_in_an_earlier_layout_is_upgraded(tmp_path, rng):
    """A tree that once kept "w" flat [6] (now [2, 3]) and "b" as it is: its checkpoints of
    then and of now both restore into today's layout, whichever is newest, and the layout is
    told by the stored shapes, not by any error."""
    w, b = (rng.standard_normal(shape).astype(np.float32) for shape in ((2, 3), 4))
    today = {"w": jnp.asarray(w), "b": jnp.asarray(b)}
    flat = {"w": jnp.asarray(w).reshape(6), "b": jnp.asarray(b)}
    earlier = EarlierLayout(like=jax.eval_shape(lambda t: {**t, "w": t["w"].reshape(6)}, today),
                            upgrade=lambda t: {**t, "w": t["w"].reshape(2, 3)})
    ckpt = Checkpointer(tmp_path, keep=None, async_save=False)
    ckpt.save(1, flat)
    ckpt.save(2, today)
    like = jax.eval_shape(lambda t: t, today)
    for step, upgraded in ((1, True), (2, False)):
        r = ckpt.restore(like, step, earlier=[earlier])
        assert r.upgraded == upgraded
        assert_trees_equal(today, r.tree)
    with pytest.raises(CheckpointError, match=r"array \['w'\] has shape \[6\], the tree "
                                              r"\[2, 3\]"):
        ckpt.restore(like, 1)  # without the earlier layout: the mismatch as ever
    # The newest verifying checkpoint, in either layout; a partial restore too.
    flip_byte(array_file(tmp_path / "step_00000002", "['w']"))
    r = ckpt.restore(like, fallback=True, on_skip=lambda *a: None, earlier=[earlier])
    assert r.step == 1 and r.upgraded
    assert_trees_equal(today, r.tree)
    r = ckpt.restore({"b": like["b"]}, 1, partial=True, earlier=[earlier])
    assert not r.upgraded and np.asarray(r.tree["b"]).tobytes() == b.tobytes()

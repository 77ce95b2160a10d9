"""The faults a user can make with `export` (issue 47): a target that is the run's own folder
or holds other files, one that is a device, pipe, socket or link, a disk that fills up. Each
ends in one line on stderr and exit status 2, never a traceback, with nothing the user had
lost: the run, other files, an earlier export all as they were, no temporary left behind.

One tiny run of two steps, trained once for the module, is exported again and again. What
needs the corpus and the tokenizer skips without them (see tests/test_gpt2_cli.py).
"""

import errno
import os
import signal
import socket
import stat
from pathlib import Path

import numpy as np
import pytest

from blujax import cli, interop
from tests.test_gpt2_cli import _assert_usage_error, _run, corpus, private_cache  # noqa: F401

pytestmark = pytest.mark.slow  # end to end: outside the fast tier (-m "not slow")


@pytest.fixture(scope="module")
def run(corpus, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("export") / "run"
    assert cli.main([str(a) for a in [
        "train", "--data", corpus, "--model", "tiny", "--steps", 2, "--batch", 2, "--seq", 32,
        "--eval-every", 0, "--no-progress", "--sample-tokens", 0, "--out", out]]) == 0
    return out


@pytest.fixture(scope="module")
def hf_export(run, tmp_path_factory):
    """A complete Hugging Face export of the run, to copy where an earlier one is wanted."""
    to = tmp_path_factory.mktemp("hf") / "hf"
    assert cli.main(["export", "--out", str(run), "--format", "hf", "--to", str(to)]) == 0
    return to


def _export(capsys, run, fmt, to, *more):
    return _run(capsys, "export", "--out", run, "--format", fmt, "--to", to, *more)


def _tree(path: Path) -> dict:
    """{relative name: bytes (or "link -> target", or the kind)} of everything under path."""
    found = {}
    for p in sorted([path, *path.rglob("*")] if path.is_dir() else [path]):
        name = str(p.relative_to(path)) if p != path else "."
        if p.is_symlink():
            found[name] = f"link -> {os.readlink(p)}"
        elif p.is_file():
            found[name] = p.read_bytes()
        else:
            found[name] = stat.S_IFMT(p.lstat().st_mode)
    return found


def _no_temporaries(*paths: Path):
    """No hidden temporary (.NAME.*.tmp, .NAME.*.old) beside paths, nor inside them."""
    for path in paths:
        for folder in (path.parent, path):
            if folder.is_dir() and not folder.is_symlink():
                left = [p.name for p in folder.iterdir() if p.name.startswith(f".{path.name}.")
                        or p.name.endswith((".tmp", ".old"))]
                assert not left, left


def _copy_export(hf_export: Path, to: Path) -> Path:
    to.mkdir()
    for p in hf_export.iterdir():
        (to / p.name).write_bytes(p.read_bytes())
    return to


# --------------------------------------------------------------------------------------------
# 1. The wrong folder, the wrong file


@pytest.mark.parametrize("more", [[], ["--overwrite"]])
def test_the_runs_own_folder_is_refused_even_with_overwrite(run, capsys, more):
    before = _tree(run)
    status, _, err = _export(capsys, run, "hf", run, *more)
    _assert_usage_error(status, err, f"{run}: is a blujax run folder")
    for words in ("config.json with the run's settings, ckpt/", "refused even with --overwrite",
                  f"e.g. {run / 'hf'}"):
        assert words in err
    assert _tree(run) == before
    _no_temporaries(run)
    status, _, err = _export(capsys, run, "hf", run / "ckpt", *more)
    _assert_usage_error(status, err, f"lies in ckpt/ of the blujax run {run}")
    assert _tree(run) == before


def test_a_folder_of_other_files_needs_overwrite_and_keeps_them(run, tmp_path, capsys):
    to = tmp_path / "mine"
    (to / "data").mkdir(parents=True)
    (to / "notes.txt").write_text("my notes")
    (to / "README.md").write_text("# my model")
    (to / "config.json").write_text('{"learning_rate": 3}')  # another tool's config
    before = _tree(to)
    status, _, err = _export(capsys, run, "hf", to)
    _assert_usage_error(status, err, f"{to}: holds files an export does not write (README.md, "
                                     f"config.json, data/ and 1 more); --overwrite exports")
    assert _tree(to) == before
    _no_temporaries(to)

    status, stdout, err = _export(capsys, run, "hf", to, "--overwrite")
    assert status == 0 and f"written to {to}" in stdout, err
    after = _tree(to)
    assert {k: after[k] for k in ("notes.txt", "README.md", "data")} == {
        k: before[k] for k in ("notes.txt", "README.md", "data")}
    assert interop.read_hf_dir(to).family == "gpt2"  # config.json is the export's now
    _no_temporaries(to)


def test_an_earlier_export_is_replaced_whole(run, hf_export, tmp_path, capsys):
    to = _copy_export(hf_export, tmp_path / "hf")
    (to / "tokenizer.json").write_text("{}")  # a stale file of an export of another model
    status, _, err = _export(capsys, run, "hf", to)
    assert status == 0, err
    assert _tree(to) == _tree(hf_export)
    _no_temporaries(to)


@pytest.mark.parametrize("more", [[], ["--overwrite"]])
def test_llmc_refuses_the_runs_files_even_with_overwrite(run, capsys, more):
    before = _tree(run)
    status, _, err = _export(capsys, run, "llmc", run / "config.json", *more)
    _assert_usage_error(status, err, f"{run / 'config.json'}: is a file of the blujax run {run}, "
                                     f"not an llm.c model file; refused even with --overwrite")
    status, _, err = _export(capsys, run, "llmc", run / "ckpt" / "model.bin", *more)
    _assert_usage_error(status, err, "lies in ckpt/ of the blujax run")
    assert _tree(run) == before
    _no_temporaries(run / "config.json")


def test_llmc_replaces_a_model_file_and_another_file_only_with_overwrite(run, tmp_path, capsys):
    mine = tmp_path / "notes.bin"
    mine.write_text("not a model")
    status, _, err = _export(capsys, run, "llmc", mine)
    _assert_usage_error(status, err, f"{mine}: exists and is not an llm.c model file; "
                                     f"--overwrite replaces it")
    assert mine.read_text() == "not a model"
    assert _export(capsys, run, "llmc", mine, "--overwrite")[0] == 0
    assert interop.read_llmc(mine).family == "gpt2"
    # An llm.c model file, or an empty file, is replaced without asking.
    assert _export(capsys, run, "llmc", mine, "--dtype", "bf16")[0] == 0
    assert np.frombuffer(mine.read_bytes()[:8], "<i4")[1] == 5
    (tmp_path / "empty.bin").touch()
    assert _export(capsys, run, "llmc", tmp_path / "empty.bin")[0] == 0
    _no_temporaries(mine, tmp_path / "empty.bin")


# --------------------------------------------------------------------------------------------
# 2. Devices, pipes, sockets, links


@pytest.fixture
def specials(tmp_path):
    """A named pipe, a socket and a link to the pipe."""
    fifo, sock, link = tmp_path / "pipe", tmp_path / "sock", tmp_path / "link.bin"
    os.mkfifo(fifo)
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(sock))
    link.symlink_to(fifo)
    yield {"named pipe": fifo, "socket": sock, "link": link}
    s.close()


@pytest.mark.parametrize("more", [[], ["--overwrite"]])
def test_no_device_pipe_or_socket_is_replaced(run, specials, capsys, more):
    for kind, path in specials.items():
        kind = "named pipe" if kind == "link" else kind
        status, _, err = _export(capsys, run, "llmc", path, *more)
        _assert_usage_error(status, err, f"{path}: is a {kind}, not a regular file")
        status, _, err = _export(capsys, run, "hf", path, *more)
        _assert_usage_error(status, err, f"{path}: exists and is not a folder (a {kind})")
    assert stat.S_ISFIFO(specials["named pipe"].lstat().st_mode)
    assert stat.S_ISSOCK(specials["socket"].lstat().st_mode)
    assert specials["link"].is_symlink()
    _no_temporaries(*specials.values())


def test_links_are_written_through(run, tmp_path, capsys):
    real = tmp_path / "models"
    real.mkdir()
    (tmp_path / "model.bin").symlink_to(real / "model.bin")  # dangling: the file is made
    (tmp_path / "hf").symlink_to(real / "hf")
    for fmt, name in (("llmc", "model.bin"), ("llmc", "model.bin"), ("hf", "hf"), ("hf", "hf")):
        status, _, err = _export(capsys, run, fmt, tmp_path / name)
        assert status == 0, err
        assert (tmp_path / name).is_symlink(), name
        assert os.readlink(tmp_path / name) == str(real / name)
    assert interop.read_llmc(real / "model.bin").family == "gpt2"
    assert interop.read_hf_dir(real / "hf").family == "gpt2"
    _no_temporaries(real / "model.bin", real / "hf", tmp_path / "model.bin")


# --------------------------------------------------------------------------------------------
# 3. A full disk, a failed write


def _enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_leaves_no_half_hf_folder(run, hf_export, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("safetensors.numpy.save_file", _enospc)
    to = tmp_path / "new"
    status, _, err = _export(capsys, run, "hf", to)
    _assert_usage_error(status, err, f"cannot write {to}: No space left on device")
    assert not to.exists()
    _no_temporaries(to)
    # An earlier complete export stays as it was.
    earlier = _copy_export(hf_export, tmp_path / "earlier")
    before = _tree(earlier)
    status, _, err = _export(capsys, run, "hf", earlier)
    _assert_usage_error(status, err, f"cannot write {earlier}: No space left on device")
    assert _tree(earlier) == before
    _no_temporaries(earlier)


def test_a_failed_move_into_place_puts_the_earlier_export_back(run, hf_export, tmp_path,
                                                               capsys, monkeypatch):
    earlier = _copy_export(hf_export, tmp_path / "earlier")
    (earlier / "notes.txt").write_text("mine")
    before = _tree(earlier)
    rename, calls = os.rename, []

    def flaky(src, dst):  # the third move fails: some old files aside, some new ones in
        calls.append(dst)
        if len(calls) == len(list(hf_export.iterdir())) + 2:
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(src))
        rename(src, dst)

    monkeypatch.setattr(os, "rename", flaky)
    status, _, err = _export(capsys, run, "hf", earlier, "--overwrite")
    _assert_usage_error(status, err, f"cannot write {earlier}: Input/output error")
    monkeypatch.undo()
    assert _tree(earlier) == before
    _no_temporaries(earlier)


def test_a_full_disk_leaves_an_earlier_llmc_file(run, tmp_path, capsys, monkeypatch):
    path = tmp_path / "model.bin"
    assert _export(capsys, run, "llmc", path)[0] == 0
    before = path.read_bytes()
    monkeypatch.setattr(os, "fsync", _enospc)  # where a delayed allocation fails
    status, _, err = _export(capsys, run, "llmc", path, "--dtype", "bf16")
    _assert_usage_error(status, err, f"cannot write {path}: No space left on device")
    assert path.read_bytes() == before
    _no_temporaries(path)


@pytest.fixture
def file_size_limit():
    """Writes past 1 MiB fail with EFBIG, a real failed write as a full disk's is."""
    resource = pytest.importorskip("resource")
    limits, handler = resource.getrlimit(resource.RLIMIT_FSIZE), signal.getsignal(signal.SIGXFSZ)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the process is killed
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, limits[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, handler)


def test_a_real_failed_write_is_one_line(run, tmp_path, capsys, request):
    """Not monkeypatched: safetensors' own error (a SafetensorError) and Python's, both."""
    request.getfixturevalue("file_size_limit")
    for name, fmt in (("hf", "hf"), ("model.bin", "llmc")):
        status, _, err = _export(capsys, run, fmt, tmp_path / name)
        _assert_usage_error(status, err, f"cannot write {tmp_path / name}: File too large")
        assert not (tmp_path / name).exists()
        _no_temporaries(tmp_path / name)


def _raise(error):
    def fail(path, *args, **kwargs):
        raise OSError(error, os.strerror(error), str(path))
    return fail


def test_the_library_raises_interop_errors(tmp_path, monkeypatch):
    """export_hf and export_llmc themselves: an InteropError of one line, whatever the OSError,
    and no --overwrite: an earlier export is replaced, other files are not."""
    import jax
    from blujax.model import gpt2
    config = gpt2.GPT2Config(n_layer=1, n_head=1, n_embd=8, block_size=8, vocab_size=100,
                             padded_vocab_size=128)
    shapes = jax.eval_shape(lambda k: gpt2.init(config, k), jax.random.key(0))
    params = jax.tree.map(lambda s: np.zeros(s.shape, np.float32), shapes)
    interop.export_hf(params, config, tmp_path / "hf", tokenizer=False)
    interop.export_hf(params, config, tmp_path / "hf", tokenizer=False)
    (tmp_path / "hf" / "notes.txt").write_text("mine")
    with pytest.raises(interop.InteropError, match="notes.txt"):
        interop.export_hf(params, config, tmp_path / "hf", tokenizer=False)
    interop.export_hf(params, config, tmp_path / "hf", tokenizer=False, overwrite=True)
    before = _tree(tmp_path)
    with monkeypatch.context() as m:
        m.setattr(os, "mkdir", _raise(errno.EACCES))
        with pytest.raises(interop.InteropError,
                           match=f"^cannot write {tmp_path}/new: Permission denied$"):
            interop.export_hf(params, config, tmp_path / "new")
    with monkeypatch.context() as m:
        m.setattr(os, "open", _raise(errno.EROFS))
        with pytest.raises(interop.InteropError,
                           match=f"^cannot write {tmp_path}/m.bin: Read-only file system$"):
            interop.export_llmc(params, config, tmp_path / "m.bin")
    assert _tree(tmp_path) == before

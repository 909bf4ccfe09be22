"""The memory-mapped token cache: made once, mapped later, never trusted when stale, corrupt or foreign; kept in the
user cache directory, never beside the data; two processes creating it at once."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainer2.data import token_cache as tc
from trainer2.data.dataset import DataError
from trainer2.data.load import load_dataset
from trainer2.running.checkpoint import data_fingerprint

TEXT = "The quick brown fox jumps over the lazy dog; naïve café, 42.\n"


@pytest.fixture
def corpus(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "usercache"))
    d = tmp_path / "data"
    d.mkdir()
    f = d / "corpus.txt"
    f.write_text(TEXT * 300, encoding="utf-8")
    return f


def load(f: Path, where: str = "auto"):
    return load_dataset(str(f), 8, 0.1, where)


def same_as_in_memory(data, f: Path) -> bool:
    ref = load_dataset(str(f), 8, 0.1)
    return (
        data.vocab == ref.vocab
        and torch.equal(data.train, ref.train)
        and torch.equal(data.heldout, ref.heldout)
        and data.train.dtype == ref.train.dtype
    )


def no_tokenizing(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("tokenized again")

    monkeypatch.setattr(tc, "codepoint_chunks", refuse)


def test_the_first_load_writes_the_cache_and_later_ones_map_it(corpus, monkeypatch):
    first = load(corpus)
    assert same_as_in_memory(first, corpus) and tc.cache_path(corpus, "auto").is_file()
    assert tc.cache_path(corpus, "auto").parent == tmp_cache(corpus) / "trainer2" / "tokens"
    assert sorted(p.name for p in corpus.parent.iterdir()) == ["corpus.txt"]  # nothing beside the data
    no_tokenizing(monkeypatch)
    second = load(corpus)
    assert same_as_in_memory(second, corpus)
    # the cache's hash of the tokens is the data fingerprint's: checkpoints of in-memory runs still resume
    assert second.digest is not None and data_fingerprint(second) == data_fingerprint(load_dataset(str(corpus), 8, 0.1))


def test_chunks_that_split_a_character_or_mix_ascii_give_the_same_tokens(corpus, monkeypatch):
    corpus.write_text("plain ascii " * 5 + "é€😀 ünïcödé " * 7 + "ascii again " * 5, encoding="utf-8")
    monkeypatch.setattr(tc, "CHUNK", 5)  # every multi-byte character lands across some chunk boundary
    assert same_as_in_memory(load(corpus), corpus)
    corpus.write_bytes(b"ok ascii " * 10 + b"\xff bad")
    with pytest.raises(DataError, match="not valid UTF-8 .*offset 90"):
        load(corpus, "off")
    with pytest.raises(DataError, match="not valid UTF-8 .*offset 90"):
        load(corpus)


def test_a_changed_source_is_tokenized_again(corpus):
    load(corpus)
    stat = corpus.stat()
    corpus.write_text((TEXT * 300).replace("fox", "cat"), encoding="utf-8")  # same size
    os.utime(corpus, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # and the same mtime: the hash still tells
    assert same_as_in_memory(load(corpus), corpus)
    corpus.write_text(TEXT * 200 + "new characters: ÆØÅ\n", encoding="utf-8")
    assert same_as_in_memory(load(corpus), corpus)


@pytest.mark.parametrize("damage", ["tokens", "header", "truncate", "foreign", "empty"])
def test_a_corrupt_or_foreign_cache_is_rebuilt_not_trusted(corpus, damage):
    load(corpus)
    path = tc.cache_path(corpus, "auto")
    raw = bytearray(path.read_bytes())
    if damage == "tokens":
        raw[tc.ALIGN + 5] ^= 0x01  # a valid-looking id, but the wrong one
    elif damage == "header":
        raw[-3] ^= 0x20
    elif damage == "truncate":
        raw = raw[:-100]
    elif damage == "foreign":
        raw = bytearray(b"PK\x03\x04 not a token cache at all" * 50)
    else:
        raw = bytearray()
    path.write_bytes(bytes(raw))
    with pytest.raises(DataError):
        tc.read_cache(path, tc.source_fingerprint(corpus))
    assert same_as_in_memory(load(corpus), corpus)
    assert tc.read_cache(path, tc.source_fingerprint(corpus)) is not None  # rewritten whole


def tmp_cache(corpus: Path) -> Path:
    """The test's $XDG_CACHE_HOME (the corpus fixture's)."""
    return corpus.parent.parent / "usercache"


def test_the_cache_is_never_written_beside_the_data(corpus, monkeypatch):
    write = tc.write_cache

    def never_beside_data(path, *args):
        assert path.parent != corpus.parent, "wrote the cache into the data folder"
        return write(path, *args)

    monkeypatch.setattr(tc, "write_cache", never_beside_data)
    monkeypatch.setattr(tc, "open", lambda p, mode="r": _refuse_writes_beside(corpus, p, mode), raising=False)
    data = load(corpus)
    assert same_as_in_memory(data, corpus)
    assert list(tc.user_cache_dir().glob("corpus.txt.*" + tc.SUFFIX))
    assert sorted(p.name for p in corpus.parent.iterdir()) == ["corpus.txt"]


def _refuse_writes_beside(corpus: Path, p, mode: str):
    if "r" not in mode and Path(p).parent == corpus.parent:
        raise AssertionError(f"opened {p} for writing in the data folder")
    return open(p, mode)


def test_two_files_of_one_name_have_caches_of_their_own(corpus):
    other = corpus.parent.parent / "other" / corpus.name
    other.parent.mkdir()
    other.write_text("Entirely different words here.\n" * 200, encoding="utf-8")
    assert same_as_in_memory(load(corpus), corpus)
    assert same_as_in_memory(load(other), other)
    assert tc.cache_path(corpus, "auto") != tc.cache_path(other, "auto")
    assert same_as_in_memory(load(corpus), corpus)  # its cache was not overwritten by the other's


def test_an_unusable_user_cache_directory_is_a_clear_error(corpus, monkeypatch):
    blocker = corpus.parent.parent / "not_a_directory"
    blocker.write_text("x")  # a file where the cache directory would go: no one can create it, root included
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    with pytest.raises(DataError, match=r"cannot write a token cache .*--token_cache DIR .*--token_cache off"):
        load(corpus)
    assert same_as_in_memory(load(corpus, "off"), corpus)


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes into read-only directories")
def test_a_really_read_only_data_directory_works(corpus):
    corpus.parent.chmod(0o555)
    try:
        assert same_as_in_memory(load(corpus), corpus)
    finally:
        corpus.parent.chmod(0o755)


def test_a_valid_cache_in_a_read_only_directory_is_mapped_without_writing(corpus, monkeypatch):
    load(corpus)

    def no_writes(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tc, "write_cache", no_writes)
    no_tokenizing(monkeypatch)
    assert same_as_in_memory(load(corpus), corpus)


def test_an_unwritable_cache_directory_is_a_clear_error(corpus, monkeypatch):
    def no_writes(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tc, "write_cache", no_writes)
    with pytest.raises(DataError, match="--token_cache"):
        load(corpus, str(corpus.parent / "cachedir"))


def test_off_tokenizes_in_memory_and_writes_nothing(corpus):
    assert same_as_in_memory(load(corpus, "off"), corpus)
    assert sorted(p.name for p in corpus.parent.iterdir()) == ["corpus.txt"]


CHILD = """
import hashlib, sys
from trainer2.data import token_cache as tc
from trainer2.data.load import load_dataset
from trainer2.running.checkpoint import data_fingerprint
write = tc.write_cache
def counted(*args):
    print("wrote", flush=True)
    return write(*args)
tc.write_cache = counted
data = load_dataset(sys.argv[1], 8, 0.1, "auto")
print("tokens", hashlib.sha256(data.train.numpy().tobytes() + data.heldout.numpy().tobytes()).hexdigest())
"""


def test_two_processes_creating_the_cache_at_once_tokenize_once_and_agree(corpus):
    corpus.write_text(TEXT * 40000, encoding="utf-8")  # ~2.5 MB: long enough for the two to overlap
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    procs = [
        subprocess.Popen([sys.executable, "-c", CHILD, str(corpus)], stdout=subprocess.PIPE, text=True, env=env)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs)
    lines = "".join(outs).split()
    assert lines.count("wrote") == 1  # the lock: one tokenizes, the other waits and maps its file
    hashes = {line for line in "".join(outs).splitlines() if line.startswith("tokens")}
    assert len(hashes) == 1
    assert not [p for p in tc.user_cache_dir().iterdir() if p.name.endswith(".tmp")]  # no temporary file left
    assert sorted(p.name for p in corpus.parent.iterdir()) == ["corpus.txt"]

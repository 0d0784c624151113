"""lora/adapter_files.py and the confined reads of peft_format (issue 42): the file checked
is the file read, links out of the root are refused at inspection and at every read after,
links inside are followed, only regular files are read (a FIFO does not hang the reader),
messages name ``shown``, and a confined adapter's base_model_name_or_path outside its root
is never opened (watched with inotify, on Linux)."""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from loraplex.errors import AdapterConfinementError
from loraplex.lora.adapter_files import AdapterFiles, MissingFile, opened_path
from loraplex.lora.base_shapes import BaseShapes
from loraplex.lora.peft_checks import AdapterError
from loraplex.lora.peft_format import inspect_peft_adapter, read_peft_adapter

from tests.adapter_dirs import edit_config

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


@pytest.fixture()
def tree(good: Path, tmp_path: Path) -> dict[str, Path]:
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    shutil.copytree(good, outside)
    shutil.copytree(good, root / "ad")
    return {"root": root.resolve(), "outside": outside.resolve(), "ad": (root / "ad").resolve()}


def test_open_reads_the_file_it_checked(tree: dict[str, Path]) -> None:
    files = AdapterFiles(tree["ad"], tree["root"])
    with files.open(CONFIG) as f:
        assert opened_path(f.fileno()) == tree["ad"] / CONFIG
        (tree["ad"] / CONFIG).unlink()  # renamed or removed meanwhile: the open file is read
        (tree["ad"] / CONFIG).symlink_to(tree["outside"] / CONFIG)
        assert json.loads(f.read())["peft_type"] == "LORA"
    with pytest.raises(AdapterConfinementError, match="outside"), files.open(CONFIG):
        pass


def test_links_inside_the_root_are_followed_and_outside_refused(tree: dict[str, Path]) -> None:
    ad, root = tree["ad"], tree["root"]
    (root / "blobs").mkdir()
    shutil.move(ad / WEIGHTS, root / "blobs" / "w")
    (ad / WEIGHTS).symlink_to(Path("..") / "blobs" / "w")  # the HF cache's layout
    with AdapterFiles(ad, root).open(WEIGHTS) as f:
        assert opened_path(f.fileno()) == root / "blobs" / "w"
    # a narrower root: now outside it
    with pytest.raises(AdapterConfinementError), AdapterFiles(ad, ad).open(WEIGHTS):
        pass


def test_only_regular_files_are_read(tree: dict[str, Path]) -> None:
    ad = tree["ad"]
    (ad / CONFIG).unlink()
    os.mkfifo(ad / CONFIG)  # no writer: a blocking open would hang here
    with pytest.raises(AdapterError, match="not a regular file"), \
            AdapterFiles(ad, tree["root"]).open(CONFIG):
        pass
    with pytest.raises(MissingFile, match="<upload x>/nothing is missing"), \
            AdapterFiles(ad, tree["root"], "<upload x>").open("nothing"):
        pass


def test_inspect_and_every_read_after_are_confined(tree: dict[str, Path],
                                                   llama: BaseShapes) -> None:
    ad, root = tree["ad"], tree["root"]
    meta = inspect_peft_adapter(ad, llama, 8, root=root, shown="<resolver r>")
    assert (meta.root, meta.shown) == (root, "<resolver r>")
    assert read_peft_adapter(ad, llama, 8, meta=meta, root=root, shown=meta.shown).layers
    (ad / WEIGHTS).unlink()  # swapped after registration for a link out
    (ad / WEIGHTS).symlink_to(tree["outside"] / WEIGHTS)
    with pytest.raises(AdapterConfinementError) as info:
        read_peft_adapter(ad, llama, 8, meta=meta, root=root, shown=meta.shown)
    assert str(info.value).startswith("<resolver r>/adapter_model.safetensors is a link")
    assert str(root) not in str(info.value) and str(tree["outside"]) not in str(info.value)
    assert read_peft_adapter(ad, llama, 8).layers  # unconfined (an operator's path): read


def test_messages_name_shown_not_the_directory(tree: dict[str, Path],
                                               llama: BaseShapes) -> None:
    ad = tree["ad"]
    (ad / CONFIG).write_text("{not json")
    with pytest.raises(AdapterError) as info:
        inspect_peft_adapter(ad, llama, 8, root=tree["root"], shown="<upload u>")
    assert str(info.value).startswith("<upload u>/adapter_config.json is not readable JSON")
    assert str(tree["root"]) not in str(info.value)


@contextmanager
def watch_opens(path: Path) -> Iterator[Callable[[], int]]:
    """Count the opens of ``path`` (inotify IN_OPEN) while the block runs."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    if not hasattr(libc, "inotify_init1"):
        pytest.skip("inotify is Linux's")
    fd = libc.inotify_init1(os.O_NONBLOCK)
    assert fd >= 0 and libc.inotify_add_watch(fd, str(path).encode(), 0x20) >= 0  # IN_OPEN

    def opens() -> int:
        try:
            return len(os.read(fd, 65536)) // 16  # events without a name: 16 bytes each
        except BlockingIOError:
            return 0

    try:
        yield opens
    finally:
        os.close(fd)


def test_a_confined_adapter_never_opens_a_base_path_outside_its_root(
        tree: dict[str, Path], llama: BaseShapes, tiny_models: Callable[[str], Path]) -> None:
    wide = tree["outside"] / "wide"
    wide.mkdir()
    cfg = json.loads((tiny_models("llama") / "config.json").read_text())
    (wide / "config.json").write_text(json.dumps({**cfg, "hidden_size": 128}))
    edit_config(tree["ad"], base_model_name_or_path=str(wide))
    with watch_opens(wide / "config.json") as opens:
        meta = inspect_peft_adapter(tree["ad"], llama, 8, root=tree["root"])
        assert meta.base_model_name_or_path == str(wide) and opens() == 0
        with pytest.raises(AdapterError, match="differs from the served base"):
            inspect_peft_adapter(tree["ad"], llama, 8)  # unconfined: compared, refused
        assert opens() >= 1  # the watch sees an open when there is one
    inside = tree["root"] / "wide"  # inside the root: followed, compared
    shutil.copytree(wide, inside)
    edit_config(tree["ad"], base_model_name_or_path=str(inside))
    with pytest.raises(AdapterError, match="differs from the served base") as info:
        inspect_peft_adapter(tree["ad"], llama, 8, root=tree["root"], shown="<upload w>")
    assert str(llama.name_or_path) not in str(info.value)  # not the served model's dir

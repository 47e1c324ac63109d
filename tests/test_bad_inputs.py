"""Bad records in user data: no silent success, and one bad record never stops a run.

Each bad line, row or caption is left out and named (file, line, why); a file that is not text
at all, or has nothing usable, is one ValueError naming it.
"""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from dit_train.data_pipelines.synthetic_video import ensure_synthetic_videos
from dit_train.data_pipelines.text import load_text_datasets, read_corpus, scan_corpus
from dit_train.data_pipelines.video_dataset import VideoClipDataset, scan_manifest
from dit_train.data_pipelines.video_folder import index_video_folder, list_clips, scan_clips

GOOD = [{"text": f"document number {i} is long enough to train on"} for i in range(20)]


def write_jsonl(path: Path, rows: list, extra: bytes = b"") -> Path:
    path.write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in rows) + extra)
    return path


def texts(ds) -> list[str]:
    return [ds.tokenizer.decode(d.ids) for d in ds.docs]


# -- text corpora (mode=llm) ---------------------------------------------------------------------

def test_binary_file_is_refused_naming_the_file(tmp_path):
    blob = bytes(range(256)) * 40  # NUL bytes and invalid UTF-8, as any binary file has
    (tmp_path / "weights.bin").write_bytes(blob)
    with pytest.raises(ValueError, match=r"weights\.bin looks binary: it holds NUL bytes"):
        load_text_datasets(str(tmp_path / "weights.bin"), "byte", 64, 0.0)
    # no NUL, but mostly not UTF-8 (e.g. a compressed file or a Latin-1 text): refused as well
    (tmp_path / "data.gz").write_bytes(bytes(b for b in blob if b) + b"\n" + blob[128:].replace(b"\x00", b"\n"))
    with pytest.raises(ValueError, match=r"data\.gz looks binary or is not UTF-8: \d+% of its paragraphs are not"):
        load_text_datasets(str(tmp_path / "data.gz"), "byte", 64, 0.0)


def test_a_binary_corpus_is_refused_at_its_first_chunk_not_read_whole(tmp_path, monkeypatch):
    """The NUL check runs on each chunk as it is read: a 20 MB binary file costs one chunk of
    memory (it used to be read whole first: /dev/zero was OOM-killed), and the line is right
    across chunk boundaries; devices, pipes and folders are refused without reading."""
    import os
    import tracemalloc

    import dit_train.data_pipelines.text as text

    monkeypatch.setattr(text, "CHUNK", 16)
    p = tmp_path / "model.bin"
    p.write_bytes(b"first line\r\nsecond line\n\x00" + b"x" * 20_000_000)
    tracemalloc.start()
    with pytest.raises(ValueError, match=r"model\.bin looks binary: it holds NUL bytes \(first on line 3\)"):
        load_text_datasets(str(p), "byte", 64, 0.0)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 1_000_000, peak
    os.mkfifo(tmp_path / "pipe.txt")
    for path, kind in (("/dev/zero", "a character device"), (str(tmp_path / "pipe.txt"), "a named pipe"),
                       (str(tmp_path), "a folder")):
        with pytest.raises(ValueError, match=f"data.text_path={path} is {kind}, not a file"):
            load_text_datasets(path, "byte", 64, 0.0)


def test_null_text_is_skipped_and_counted_not_trained_as_None(tmp_path):
    p = write_jsonl(tmp_path / "corpus.jsonl", GOOD[:3] + [{"text": None}] + GOOD[3:])
    train, _ = load_text_datasets(str(p), "byte", 256, 0.0)
    assert len(train) == 20 and not any("None" in t for t in texts(train))
    assert [tuple(s) for s in train.skipped] == [(str(p), 4, '"text" is null')]
    assert train.report.records == 21


def test_non_string_fields_and_non_objects_are_skipped_with_line_numbers(tmp_path, caplog):
    bad = [{"prompt": 5}, {"text": 3.5}, {"text": ["a"]}, {"text": {"a": 1}}, {"prompt": "q", "completion": None},
           [1, 2], "just a string", {"title": "no text field"}]
    p = write_jsonl(tmp_path / "mixed.jsonl", GOOD[:2] + bad + GOOD[2:], extra=b'not json\n{"text": "\\ud800"}\n')
    with caplog.at_level(logging.WARNING):
        train, _ = load_text_datasets(str(p), "byte", 256, 0.0)  # used to raise AttributeError on {"prompt": 5}
    assert len(train) == 20
    assert [(s.line, s.why) for s in train.skipped] == [
        (3, '"prompt" is a number (5)'), (4, '"text" is a number (3.5)'), (5, '"text" is a list'),
        (6, '"text" is an object'), (7, '"completion" is null'), (8, "not a JSON object (a list)"),
        (9, "not a JSON object (a string)"), (10, 'no "text" (or "prompt") field'),
        (29, "not JSON (Expecting value: column 1)"), (30, '"text" holds an unpaired surrogate (\\ud800)')]
    assert f'skipped 10 line(s) of {p}: line 3: "prompt" is a number (5); line 4:' in caplog.text
    assert "and 7 more" in caplog.text


def test_upper_case_jsonl_extension_is_read_as_jsonl(tmp_path):
    p = write_jsonl(tmp_path / "CORPUS.JSONL", GOOD + [{"prompt": "Q: 1+1?", "completion": " 2"}])
    docs = read_corpus(str(p))
    assert [t for _, t in docs[:20]] == [r["text"] for r in GOOD]  # the text, not the JSON line
    assert docs[20] == ("20\x00prompt", json.dumps(["Q: 1+1?", " 2"]))


def test_a_few_undecodable_lines_are_skipped_and_the_rest_trains(tmp_path, caplog):
    lines = [json.dumps(r).encode() for r in GOOD] + [json.dumps(r).encode() for r in GOOD]
    lines[6] = b'{"text": "caf\xe9 au lait"}'  # Latin-1: not UTF-8
    lines[30] = b"\xff\xfe{"
    p = tmp_path / "mostly.jsonl"
    p.write_bytes(b"\r\n".join(lines) + b"\r\n")  # CRLF: line numbers as an editor shows them
    with caplog.at_level(logging.WARNING):
        train, _ = load_text_datasets(str(p), "byte", 256, 0.0)
    assert len(train) == 38 and len(train.report.undecodable) == 2
    assert [(s.line, s.why) for s in train.skipped] == [(7, "not UTF-8 (byte 0xe9) at column 14"),
                                                        (31, "not UTF-8 (byte 0xff) at column 1")]
    assert "mostly.jsonl: line 7: not UTF-8" in caplog.text
    # plain text: the paragraph holding the bad byte is left out, the others are kept
    t = tmp_path / "notes.txt"
    paras = [b"first paragraph\nstill first", b"second \xe9t\xe9", b"third"] + [b"filler %d" % i for i in range(10)]
    t.write_bytes(b"\n\n".join(paras))
    docs, report = scan_corpus(str(t))
    assert "first paragraph" in docs[0][1] and "second" not in docs[0][1] and "third" in docs[0][1]
    assert [(s.line, s.why) for s in report.skipped] == [(4, "not UTF-8 (byte 0xe9) at column 8")]
    # the same corpus is refused when less is tolerated
    with pytest.raises(ValueError, match=r"mostly\.jsonl looks binary or is not UTF-8: 5% of its lines"):
        scan_corpus(str(p), max_bad_fraction=0.02)


def test_corpus_with_no_usable_line_names_the_file(tmp_path):
    p = write_jsonl(tmp_path / "nulls.jsonl", [{"text": None}] * 3)
    with pytest.raises(ValueError, match=r'nulls\.jsonl has no usable line: .*line 1: "text" is null'):
        load_text_datasets(str(p), "byte", 64, 0.0)


# -- video folders and manifests (mode=video) ----------------------------------------------------

@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> list[tuple[Path, str]]:
    """Three real mp4 clips and their captions."""
    src = ensure_synthetic_videos(tmp_path_factory.mktemp("src"), 3, 5)
    rows = [json.loads(x) for x in (src / "manifest.jsonl").read_text().splitlines()]
    return [(src / r["path"], r["caption"]) for r in rows]


def test_non_utf8_caption_names_the_file_and_leaves_only_that_clip_out(clips, tmp_path, caplog):
    folder = tmp_path / "videos"
    folder.mkdir()
    for i, (mp4, caption) in enumerate(clips):
        shutil.copy(mp4, folder / f"clip_{i}.mp4")
        (folder / f"clip_{i}.txt").write_text(caption)
    (folder / "clip_1.txt").write_bytes("a caf\u00e9 scene".encode("latin-1"))
    with caplog.at_level(logging.WARNING):
        index = index_video_folder(folder, tmp_path / "cache", progress=False)  # used to raise UnicodeDecodeError
    assert [Path(e.path).name for e in index.entries] == ["clip_0.mp4", "clip_2.mp4"]
    assert [e.caption for e in index.entries] == [clips[0][1], clips[2][1]]
    (where, why), = index.skipped
    assert Path(where).name == "clip_1.mp4" and str(folder / "clip_1.txt") in why and "not UTF-8" in why
    assert str(folder / "clip_1.txt") in caplog.text


def test_upper_case_video_and_caption_extensions_are_found(tmp_path):
    for name in ("a.MP4", "b.Mp4", "c.mp4", "d.WEBM"):
        (tmp_path / name).write_bytes(b"not decoded by listing")
    (tmp_path / "a.TXT").write_text("caption of a")
    (tmp_path / "b.txt").write_text("caption of b")
    (tmp_path / "c.Txt").write_text("caption of c")
    (tmp_path / "e.TXT").write_text("a caption without its video")
    got = {Path(p).name: c for p, c in list_clips(tmp_path)}
    assert got == {"a.MP4": "caption of a", "b.Mp4": "caption of b", "c.mp4": "caption of c", "d.WEBM": ""}


def test_manifest_bad_rows_are_skipped_with_line_numbers(clips, tmp_path, caplog):
    good = [{"path": str(p), "caption": c} for p, c in clips]
    rows = [good[0], {"caption": "no path"}, {"path": 7, "caption": "x"}, {"path": str(clips[1][0]), "caption": 5},
            {"path": str(clips[1][0]), "caption": None}, ["not", "an", "object"], good[2]]
    m = write_jsonl(tmp_path / "VIDEOS.JSONL", rows, extra=b'{"path": "broken\n')  # upper-case extension
    with caplog.at_level(logging.WARNING):
        got, skipped = scan_clips(m)
    assert [c for _, c in got] == [good[0]["caption"], "", good[2]["caption"]]  # null caption = no caption
    assert skipped == [(f"{m}:2", 'no "path"'), (f"{m}:3", '"path" is a number (7)'),
                       (f"{m}:4", '"caption" is a number (5)'),
                       (f"{m}:6", "not a JSON object (a list)"),
                       (f"{m}:8", "not JSON (Unterminated string starting at: column 10)")]
    assert f"skipped 5 row(s) of {m}: line 2:" in caplog.text
    ds = VideoClipDataset.from_manifest(m, patch=(1, 8, 8))  # the same rows reach the dataset's skip list
    assert len(ds) == 3 and [w for w, _ in ds.skipped] == [w for w, _ in skipped]
    assert ds.entries[1].caption == ""  # not "None"
    # CSV: a row with bytes that are not UTF-8 and a row without a path; extension in upper case
    csv = tmp_path / "videos.CSV"
    csv.write_bytes(b"path,caption\n" + f"{clips[0][0]},ok\n".encode() + f"{clips[1][0]},caf\xe9\n".encode("latin-1")
                    + b",no path\n")
    rows, skipped = scan_manifest(csv)
    assert rows == [{"path": str(clips[0][0]), "caption": "ok"}]
    assert skipped == [(f"{csv}:3", "not UTF-8 (byte 0xe9)"), (f"{csv}:4", '"path" is empty')]


def test_unusable_clips_are_warned_about_once(tmp_path, caplog):
    """The data check and the training task each build the dataset: one warning, not two."""
    from dit_train.data_pipelines.video_dataset import ClipEntry
    from dit_train.data_pipelines.video_io import VideoInfo

    entries = [ClipEntry(str(tmp_path / f"clip_{i}.mp4"), "", VideoInfo(8, 32, 32, 8.0)) for i in range(2)]
    entries.append(ClipEntry(str(tmp_path / "tiny.mp4"), "", VideoInfo(8, 4, 4, 8.0)))  # smaller than a patch
    with caplog.at_level(logging.WARNING):
        datasets = [VideoClipDataset(entries, patch=(1, 8, 8)) for _ in range(2)]
    assert [len(ds) for ds in datasets] == [2, 2] and caplog.text.count("skipped 1 unusable clip(s)") == 1, caplog.text


def test_manifest_without_a_usable_row_is_an_error_naming_it(tmp_path):
    m = write_jsonl(tmp_path / "m.jsonl", [{"file": "a.mp4"}, {"path": None}])
    with pytest.raises(ValueError, match=r'manifest .*m\.jsonl has no usable row: .*line 1: no "path"'):
        list_clips(m)
    with pytest.raises(ValueError, match=r"m\.jsonl has no usable row"):
        VideoClipDataset.from_manifest(m, patch=(1, 8, 8))


def test_empty_root_is_refused_not_scanned(tmp_path, monkeypatch):
    (tmp_path / "stray.mp4").write_bytes(b"x")
    monkeypatch.chdir(tmp_path)  # "" used to mean ".": this folder would have been scanned
    for fn in (list_clips, lambda root: index_video_folder(root, tmp_path / "cache", progress=False)):
        with pytest.raises(ValueError, match=r"data=video_folder needs data.root=<folder of videos"):
            fn("")
    assert not (tmp_path / "cache").exists()
